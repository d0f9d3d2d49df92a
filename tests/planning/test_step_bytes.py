"""The decode step's HBM bytes, accounted op by op from a compiled program's text
(jaxserve/planning/step_bytes.py): each rule on a small hand-written program, then the
engine's decode step compiled for a TPU by libtpu's deviceless compiler, against its
roofline bytes."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from jaxserve.planning.hlo_text import parse_module
from jaxserve.planning.step_bytes import account, trip_count
from pallas_kernels.ragged_paged_attention.cost import pages_read

# A layer loop of 4 trips: each reads one layer's slice of stacked weights, writes a
# cache row in place from VMEM, and an attention and a gated-delta kernel run after it.
PROGRAM = """HloModule step

%fused_layer (param_0: bf16[4,256,256], param_1: s32[], param_2: f32[8,256]) -> f32[8,256] {
  %param_0 = bf16[4,256,256]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %slice = bf16[1,256,256]{2,1,0} dynamic-slice(%param_0, %param_1, %zero.1, %zero.1), dynamic_slice_sizes={1,256,256}
  %w = bf16[256,256]{1,0} bitcast(%slice)
  %param_2 = f32[8,256]{1,0} parameter(2)
  %wf = f32[256,256]{1,0} convert(%w)
  ROOT %dot = f32[8,256]{1,0} dot(%param_2, %wf), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_write (param_0.1: f32[64,128], param_1.1: f32[1,128], param_2.1: s32[]) -> f32[64,128] {
  %param_0.1 = f32[64,128]{1,0} parameter(0)
  %param_1.1 = f32[1,128]{1,0:S(1)} parameter(1)
  %param_2.1 = s32[] parameter(2)
  %zero.2 = s32[] constant(0)
  ROOT %dus = f32[64,128]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1, %zero.2)
}

%body (arg: (s32[], f32[8,256], bf16[4,256,256], f32[64,128])) -> (s32[], f32[8,256], bf16[4,256,256], f32[64,128]) {
  %arg = (s32[], f32[8,256]{1,0}, bf16[4,256,256]{2,1,0}, f32[64,128]{1,0}) parameter(0)
  %i = s32[]{:S(6)} get-tuple-element(%arg), index=0
  %x = f32[8,256]{1,0} get-tuple-element(%arg), index=1
  %weights = bf16[4,256,256]{2,1,0} get-tuple-element(%arg), index=2
  %cache = f32[64,128]{1,0} get-tuple-element(%arg), index=3
  %y = f32[8,256]{1,0} fusion(%weights, %i, %x), kind=kOutput, calls=%fused_layer, metadata={op_name="jit(step)/while/body/layers/mlp/dot_general"}
  %row = f32[1,128]{1,0:S(1)} broadcast(%i), dimensions={}
  %cache.1 = f32[64,128]{1,0} fusion(%cache, %row, %i), kind=kLoop, calls=%fused_write
  %one = s32[]{:S(6)} constant(1)
  %next = s32[]{:S(6)} add(%i, %one)
  ROOT %out = (s32[], f32[8,256]{1,0}, bf16[4,256,256]{2,1,0}, f32[64,128]{1,0}) tuple(%next, %y, %weights, %cache.1)
}

%chunk (arg.2: (s32[], s32[], f32[8,256])) -> (s32[], s32[], f32[8,256]) {
  %arg.2 = (s32[], s32[], f32[8,256]{1,0}) parameter(0)
  %j = s32[]{:S(6)} get-tuple-element(%arg.2), index=0
  %bound = s32[]{:S(6)} get-tuple-element(%arg.2), index=1
  %h = f32[8,256]{1,0} get-tuple-element(%arg.2), index=2
  %h.1 = f32[8,256]{1,0} negate(%h)
  %one.1 = s32[]{:S(6)} constant(1)
  %j.1 = s32[]{:S(6)} add(%j, %one.1)
  ROOT %out.1 = (s32[], s32[], f32[8,256]{1,0}) tuple(%j.1, %bound, %h.1)
}

%chunk_cond (arg.3: (s32[], s32[], f32[8,256])) -> pred[] {
  %arg.3 = (s32[], s32[], f32[8,256]{1,0}) parameter(0)
  %j.2 = s32[] get-tuple-element(%arg.3), index=0
  %bound.1 = s32[] get-tuple-element(%arg.3), index=1
  ROOT %more = pred[] compare(%j.2, %bound.1), direction=LT
}

%cond (arg.1: (s32[], f32[8,256], bf16[4,256,256], f32[64,128])) -> pred[] {
  %arg.1 = (s32[], f32[8,256]{1,0}, bf16[4,256,256]{2,1,0}, f32[64,128]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x0: f32[8,256], w0: bf16[4,256,256], c0: f32[64,128], q: f32[16,4,128,128], kv: bf16[100,8,16,128], pages: s32[16,1,32], s: f32[8,16,128,128], n: s32[]) -> f32[8,256] {
  %x0 = f32[8,256]{1,0} parameter(0)
  %w0 = bf16[4,256,256]{2,1,0} parameter(1)
  %c0 = f32[64,128]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,256]{1,0}, bf16[4,256,256]{2,1,0}, f32[64,128]{1,0}) tuple(%zero, %x0, %w0, %c0)
  %loop = (s32[], f32[8,256]{1,0}, bf16[4,256,256]{2,1,0}, f32[64,128]{1,0}) while(%init), condition=%cond, body=%body
  %q = f32[16,4,128,128]{3,2,1,0:S(1)} parameter(3)
  %kv = bf16[100,8,16,128]{3,2,1,0} parameter(4)
  %pages = s32[16,1,32]{2,1,0} parameter(5)
  %attn = f32[16,4,128,128]{3,2,1,0:S(1)} custom-call(%q, %kv, %pages), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"jaxserve_kernel":"ragged_paged_attention",
"sliding_window":"0"
}}, metadata={op_name="jit(step)/self_attn/pallas_call"}, backend_config={"custom_call_config":{"body":"AAAA","cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"999999999"}}}
  %s = f32[8,16,128,128]{3,2,1,0} parameter(6)
  %gdn = f32[8,16,128,128]{3,2,1,0} custom-call(%s), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"jaxserve_kernel":"gated_delta_decode",
"rows":"8"
}}, backend_config={"custom_call_config":{"cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"8000"}}}
  %n_chunks = s32[]{:S(6)} parameter(7)
  %chunk_init = (s32[], s32[], f32[8,256]{1,0}) tuple(%zero, %n_chunks, %x0)
  %chunks = (s32[], s32[], f32[8,256]{1,0}) while(%chunk_init), condition=%chunk_cond, body=%chunk, metadata={op_name="jit(step)/gated_delta/while"}
  %prefetch = (bf16[4,256,256]{2,1,0:S(1)}, bf16[4,256,256]{2,1,0}, u32[]{:S(2)}) copy-start(%w0)
  %done = bf16[4,256,256]{2,1,0:S(1)} copy-done(%prefetch)
  ROOT %result = f32[8,256]{1,0} get-tuple-element(%loop), index=1
}
"""


def by_name(rows: int, context: int) -> dict:
    ops, loops = account([("step", parse_module(PROGRAM))], rows=rows, context=context)
    # the loop whose bound is an input (a prefill-chunk loop): listed, not counted
    assert loops == [{"program": "step", "name": "chunks", "op_name": "gated_delta",
                      "bytes_per_trip": 2 * 8 * 256 * 4}]
    return {o.name: o for o in ops}


def test_the_parser_reads_loops_and_multiline_kernel_metadata():
    m = parse_module(PROGRAM)
    assert m.entry == "main" and set(m.computations) == {
        "fused_layer", "fused_write", "body", "cond", "chunk", "chunk_cond", "main"}
    main = m["main"]
    assert trip_count(m, main, main.by_name["loop"]) == 4
    assert trip_count(m, main, main.by_name["chunks"]) is None   # its bound is an input
    attn = main.by_name["attn"]
    assert attn.kernel_metadata == {"jaxserve_kernel": "ragged_paged_attention",
                                    "sliding_window": "0"}
    assert attn.cost_bytes == 999999999 and attn.shape[0].memory_space == 1
    assert [a.nbytes for a in main.by_name["kv"].shape] == [100 * 8 * 16 * 128 * 2]


def test_each_rule_charges_what_moves():
    ops = by_name(rows=2, context=100)
    # the loop body runs 4 times; the layer reads its weights' slice (not the stack) and
    # its activations, and writes its output
    layer = ops["y"]
    assert layer.runs == 4 and layer.bytes == 256 * 256 * 2 + 2 * 8 * 256 * 4
    assert layer.op_name == "layers/mlp/dot_general"
    # an in-place update from VMEM: the cache is neither read nor rewritten, the row is written
    assert ops["cache.1"].bytes == 128 * 4 and ops["cache.1"].runs == 4
    # VMEM and SMEM arrays are free (the broadcast into VMEM, the counter's add)
    assert "row" not in ops and "next" not in ops
    # attention: the pages of 2 rows at context 100 (7 pages of 16 each), and the HBM page
    # table; q and the output are in VMEM; the kernel's own estimate is not used
    page = 8 * 16 * 128 * 2
    assert pages_read(num_tokens=2, num_rows=2, pages_per_req=7, page_size=16,
                      num_pages=100) == 14
    assert ops["attn"].bytes == 14 * page + 16 * 32 * 4
    assert ops["attn"].how == "KV pages of 2 rows at context 100"
    # the gated delta kernel: its estimate for 8 rows, scaled to the 2 the step decodes
    assert ops["gdn"].bytes == 2000
    # a prefetch moves the whole array once
    assert ops["prefetch"].bytes == 4 * 256 * 256 * 2 and ops["prefetch"].runs == 1
    assert set(ops) == {"y", "cache.1", "attn", "gdn", "prefetch"}


def test_more_rows_and_context_read_more_pages_only():
    small, large = by_name(rows=1, context=16), by_name(rows=4, context=1600)
    page = 8 * 16 * 128 * 2
    assert small["attn"].bytes == 1 * page + 16 * 32 * 4
    assert large["attn"].bytes == 100 * page + 16 * 32 * 4   # capped at the cache's pages
    assert small["y"].bytes == large["y"].bytes


# XLA:TPU's ragged dot (LoRA's grouped matmul) with every array in VMEM, the slice of
# the stack it multiplies prefetched there by the fusion before it; a kernel whose x is
# in HBM and whose weights are in VMEM; and one that takes everything from HBM.
KERNELS = """HloModule kernels

%fused_slice (param_0: bf16[4,5,512,16], param_1: s32[]) -> bf16[1,5,512,16] {
  %param_0 = bf16[4,5,512,16]{3,2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %slice = bf16[1,5,512,16]{3,2,1,0:S(1)} dynamic-slice(%param_0, %param_1, %zero, %zero, %zero), dynamic_slice_sizes={1,5,512,16}
}

ENTRY %main (stack: bf16[4,5,512,16], i: s32[], x: bf16[16,512], xh: bf16[16,512]) -> f32[16,16] {
  %stack = bf16[4,5,512,16]{3,2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %a = bf16[1,5,512,16]{3,2,1,0:S(1)} fusion(%stack, %i), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/dynamic_slice"}
  %a.1 = bf16[5,512,16]{2,1,0:S(1)} bitcast(%a)
  %x = bf16[16,512]{1,0:S(1)} parameter(2)
  %rd = f32[16,16]{1,0:S(1)} custom-call(%x, %a.1), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/ragged_dot_general/ragged-dot-none"}, backend_config={"custom_call_config":{"body":"AAAA","cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"98304"}}}
  %xh = bf16[16,512]{1,0} parameter(3)
  %half = f32[16,16]{1,0:S(1)} custom-call(%xh, %a.1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"AAAA","cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"98304"}}}
  ROOT %hbm = f32[16,16]{1,0} custom-call(%xh, %stack), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"AAAA","cost_estimate":{"flops":"1","transcendentals":"0","bytes_accessed":"7777"}}}
}
"""


def test_a_kernel_is_charged_its_estimate_for_its_arrays_in_hbm_only():
    """A kernel's CostEstimate counts its VMEM operands too; the fusion that put them
    there was charged for the move already (the LoRA step's 8B decode counted the stacks
    twice: 0.93 GiB over the base step for 0.39 GiB of stacks)."""
    ops, _ = account([("step", parse_module(KERNELS))], rows=1, context=16)
    got = {o.name: o for o in ops}
    layer_slice = 5 * 512 * 16 * 2
    assert got["a"].bytes == layer_slice + 4   # the layer slice (and its index) read once
    assert "rd" not in got                 # all in VMEM: moves nothing from HBM
    x, out = 16 * 512 * 2, 16 * 16 * 4
    assert got["half"].bytes == 98304 * x // (x + layer_slice + out)
    assert got["half"].how == "CostEstimate, HBM share"
    assert got["hbm"].bytes == 7777 and got["hbm"].how == "CostEstimate"


@pytest.fixture(scope="module")
def decode_report(tmp_path_factory) -> dict:
    """The engine's decode step at 1 and 16 rows, compiled for one v6e chip: a llama
    small enough to compile in seconds, with tables too big for a TPU core's VMEM (as a
    served model's: XLA then streams them from HBM instead of prefetching them whole)."""
    pytest.importorskip("libtpu")
    from jaxserve.cli.plan import main
    path = tmp_path_factory.mktemp("step_bytes") / "config.json"
    path.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128000,
        "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--model", str(path), "--target", "tpu-v6e", "--compile", "decode",
              "--decode-rows", "1,16", "--max-num-seqs", "16", "--max-model-len", "2048",
              "--json"])
    return json.loads(out.getvalue())


def test_decode_step_bytes_are_within_15_percent_of_the_roofline(decode_report):
    steps = {d["rows"]: d for d in decode_report["decode"]}
    assert set(steps) == {1, 16}
    kv_per_token = 2 * 4 * 128 * 2 * 2                   # K and V, 4 heads, bf16, 2 layers
    for rows, d in steps.items():
        assert d["context"] == 2048 and d["ratio"] == d["step_bytes"] / d["roofline_bytes"]
        assert 0.85 <= d["ratio"] <= 1.15, d
        assert d["roofline"]["kv_read_bytes"] == rows * 2048 * kv_per_token
        # the attention kernels read exactly the rows' KV
        attn = [o for o in d["top_ops"] if o["how"].startswith("KV pages")]
        assert sum(o["total"] for o in attn) == rows * 2048 * kv_per_token
        # the lm_head (128000 x 1024, bf16) is read whole once, in the sampler
        head = [o for o in d["top_ops"] if "lm_head" in o["op_name"]]
        assert len(head) == 1 and 128000 * 1024 * 2 <= head[0]["total"] < 1.01 * 128000 * 1024 * 2
        # every op over 1 % of the step, largest first
        shares = [o["share"] for o in d["top_ops"]]
        assert shares == sorted(shares, reverse=True) and min(shares) > 0.01
        # XLA's own figure, an upper bound, is kept beside it
        assert d["compiler_bytes_accessed"] > d["step_bytes"]


@pytest.mark.parametrize("argv,message", [
    (["--decode-rows", "1,64"], "--decode-rows and --decode-context need --compile"),
    (["--decode-context", "512"], "--decode-rows and --decode-context need --compile"),
    (["--target", "tpu-v6e", "--compile", "decode", "--decode-rows", "1,x"],
     "--decode-rows '1,x': expected comma-separated row counts"),
    (["--target", "tpu-v6e", "--compile", "--max-num-seqs", "16", "--decode-rows", "64"],
     "--decode-rows 64: each must be 1 to --max-num-seqs (16)"),
    (["--target", "tpu-v6e", "--compile", "--max-model-len", "2048", "--decode-context",
      "4096"], "--decode-context 4096: must be 1 to --max-model-len (2048)"),
])
def test_decode_flags_are_refused_where_they_would_do_nothing(argv, message, capsys):
    """Refused before anything is built or compiled, naming the flag."""
    from jaxserve.cli.plan import main
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama-3.1-8b", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
