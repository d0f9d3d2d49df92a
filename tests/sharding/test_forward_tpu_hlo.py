"""The engine's whole forward step (tiny Llama, tiny Qwen3.5 hybrid) compiled for TPU v6e
by libtpu's deviceless XLA:TPU + Mosaic compilers, on one chip and on a 1x4 mesh, and
its compiled HLO checked for copies of a whole layer cache. The layers run under
jax.lax.scan (the TPU default): a layer's cache is a page range of one stacked array,
which the scanned body must never slice out into a copy.

Such a copy is what XLA:TPU inserts when the write_kv scatter and the Mosaic kernel want
the cache in different layouts (it happened with one KV head per device: two copies of
every layer's cache per step). The check reads the compiled HLO, and the compiler's
temporaries must stay below one layer's cache.
"""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.config import EngineConfig
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.planning.plan_compile import build_abstract_engine
from jaxserve.runner.programs import FORWARD
from sharding.tpu_targets import abstract_tpu_mesh, tpu_target
from tests.checkpoints import make_tiny_checkpoint
from tests.tpu_compile import compile_on_tpu

pytest.importorskip("libtpu")

TARGET = "tpu-v6e"
NUM_PAGES = 65536         # 16-token pages: 256 MiB per layer and KV head in bf16, above
                          # any activation of these tiny models, below a cache copy
# One compiled instruction per line: "%name = bf16[4096,2,16,128]{3,2,1,0...} copy(...)".
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_COPY_OPS = {"copy", "copy-start", "transpose"}


def whole_cache_copies(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """Instructions of the compiled HLO that copy or transpose an array of one of
    `shapes` (a per-device cache), including loop fusions named after a copy."""
    found = []
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, _, dims, op = m.groups()
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()
        if shape in shapes and (op in _COPY_OPS or (op == "fusion" and (
                name.startswith(("copy", "transpose")) or "calls=%copy" in line
                or "calls=%transpose" in line))):
            found.append(line.strip()[:200])
    return found


def test_the_check_finds_a_copy():
    """A cache updated without donation must be copied whole: the check sees it."""
    cache = jax.ShapeDtypeStruct((NUM_PAGES, 2, 16, 128), jnp.bfloat16)
    compiled = compile_on_tpu(lambda c: c.at[3].set(1), cache, target=TARGET)
    assert whole_cache_copies(compiled.as_text(), {cache.shape})


CHECKPOINTS = {
    # four layers: the LoRA test's stacks (per layer) must outweigh its per-token temporaries
    "llama": dict(num_attention_heads=8, num_key_value_heads=4, intermediate_size=256,
                  head_dim=128, num_hidden_layers=4),
    # Linear-attention heads of 128 as in every Qwen3.5/3.6 (at 16, narrower than a
    # lane tile, XLA:TPU relayouts the small recurrent state around the kernel).
    "qwen3_5": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                    linear_num_key_heads=4, linear_num_value_heads=8,
                    linear_key_head_dim=128, linear_value_head_dim=128),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> str:
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param),
                                **CHECKPOINTS[request.param])


def _engine(checkpoint: str, mesh: str, **engine: object):
    config = EngineConfig(model=checkpoint, mesh=mesh, load_format="dummy", dtype="bfloat16",
                          num_pages=NUM_PAGES, max_model_len=512, max_num_seqs=16,
                          max_num_batched_tokens=2048, attention_backend="pallas",
                          compilation_cache_dir=None, **engine)
    return build_abstract_engine(config, load_model_config(checkpoint),
                                 abstract_tpu_mesh(TARGET, mesh),
                                 tpu_target(TARGET).usable_hbm_bytes)


def _check_forwards(eng, mesh: str, tokens: tuple[int, ...]) -> dict[int, object]:
    """Compile the widest-page forward at each of `tokens` and check it: the Mosaic
    kernels and the layers' loop in it, no copy of a whole or one layer's cache, every
    cache donated, temporaries below one layer's cache. Returns the compiled programs."""
    assert eng.layout.scan_layers    # the TPU default: layers under jax.lax.scan
    caches = jax.tree_util.tree_leaves(eng.runner.kv_caches)
    mc = eng.layout.model_config
    # Each stacked cache per device, and one layer's share of it (what a scan body
    # would copy if XLA sliced the layer out instead of offsetting page ids).
    shapes = set()
    for kind, c in eng.runner.kv_caches.items():
        whole = c.sharding.shard_shape(c.shape)
        layers = len(mc.full_attention_layers if kind == "kv" else mc.linear_attention_layers)
        shapes |= {whole, (whole[0] // layers, *whole[1:])}
    kv_layer_bytes = NUM_PAGES * eng.cache_plan.bytes_per_page // len(
        eng.layout.model_config.full_attention_layers)
    forwards = [p for p in eng.programs if p.kind == FORWARD]
    widest = max(p.pages for p in forwards)
    out = {}
    for prog in (p for p in forwards if p.pages == widest and p.tokens in tokens):
        compiled = eng.runner.lower(prog).compile()
        hlo = compiled.as_text()
        assert "tpu_custom_call" in hlo                      # the Mosaic kernels are in it
        assert re.search(r" while\(", hlo)                   # and the layers' loop
        assert whole_cache_copies(hlo, shapes) == [], (mesh, prog.tokens)
        ma = compiled.memory_analysis()
        # Every cache is donated and updated in place...
        cache_bytes = sum(c.dtype.itemsize * math.prod(c.sharding.shard_shape(c.shape))
                          for c in caches)
        assert ma.alias_size_in_bytes >= cache_bytes
        # ...and no layer's cache is materialised a second time.
        assert ma.temp_size_in_bytes < kv_layer_bytes, (mesh, prog.tokens, ma.temp_size_in_bytes)
        out[prog.tokens] = compiled
    assert sorted(out) == sorted(tokens)
    return out


@pytest.mark.parametrize("mesh", ["1x1", "1x4"])
def test_forward_step_compiles_without_cache_copies(checkpoint, mesh):
    # XLA:TPU picks layouts per program: the write_kv scatter kept the kernel's layout
    # at small buckets and asked for another one at 2048 tokens; the smallest bucket and
    # the largest (each compile costs seconds; the LoRA check below compiles 256).
    _check_forwards(_engine(checkpoint, mesh), mesh, (16, 2048))


def test_lora_forward_step_compiles_without_copies(tmp_path):
    """The engine's LoRA step (4 slots of rank 16 beside the llama's kernels) compiled
    for v6e: the same checks, XLA:TPU's ragged dot for the adapters, the stacks (and
    each layer's slice of them) an argument that is neither donated nor copied, and
    temporaries over the base step's that could not hold them."""
    path = make_tiny_checkpoint("llama", tmp_path, **CHECKPOINTS["llama"])
    # One bucket, the larger: the adapters' temporaries grow with the tokens while the
    # stacks do not, so 256 is where "not gathered" is the tighter bound.
    tokens = (256,)
    base = _check_forwards(_engine(path, "1x1"), "1x1", tokens)
    eng = _engine(path, "1x1", enable_lora=True, max_loras=4, max_lora_rank=16)
    lora = _check_forwards(eng, "1x1", tokens)
    stacks = jax.tree_util.tree_leaves(eng.runner.lora_stacks)
    nbytes = [math.prod(x.shape) * x.dtype.itemsize for x in stacks]
    # Each stack and one layer's slice of it (the scan reads the slice in place).
    stack_shapes = {s for x in stacks if x.ndim >= 3 for s in (x.shape, x.shape[1:])}
    for t in tokens:
        hlo = lora[t].as_text()
        assert "ragged-dot" in hlo and "ragged-dot" not in base[t].as_text()
        assert whole_cache_copies(hlo, stack_shapes) == [], t
        got, want = lora[t].memory_analysis(), base[t].memory_analysis()
        # The stacks come in as a plain argument (read in place, not donated; the rank
        # padded in TPU tiles)...
        assert sum(nbytes) <= got.argument_size_in_bytes - want.argument_size_in_bytes \
            < 1.25 * sum(nbytes)
        assert got.alias_size_in_bytes == want.alias_size_in_bytes
        # ...and not gathered: the extra temporaries (the ragged dots' [T, R] and
        # [T, O], the grouping) are less than the stacks (on this tiny model, whose
        # hidden size is 64, more than the largest one).
        assert got.temp_size_in_bytes - want.temp_size_in_bytes < sum(nbytes), t
