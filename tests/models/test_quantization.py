"""Weight quantization (models/quantization.py): the quantizer against numpy, the
dequantizing matmul against a float matmul, and FP8 block checkpoints served as they are
against transformers run on the dequantized weights."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from models.config import ModelConfig, WeightQuant, resolve_weight_quant
from models.layer_stack import cache_shapes
from models.quantization import dequantize, quantize, quantized_matmul, scale_shape
from models.registry import build_model
from models.weights import load_params
from tests.checkpoints import make_fp8_block_checkpoint, make_tiny_checkpoint, model_class
from tests.models.batch_util import make_inputs
from tests.models.test_parity import assert_close, prompt

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _numpy_scales(w2: np.ndarray, block: int | None, top: float) -> np.ndarray:
    rows = w2.shape[0]
    b = rows if block is None else block
    return np.stack([np.abs(w2[i:i + b]).max(axis=0) / top for i in range(0, rows, b)])


@pytest.mark.parametrize("dtype", [np.dtype(np.int8), FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("shape,n,block", [((40, 24), 1, None), ((40, 24), 1, 16),
                                           ((4, 10, 24), 2, None), ((4, 10, 24), 2, 16),
                                           ((40, 3, 8), 1, 32)])
def test_quantize_round_trip_against_numpy(dtype, shape, n, block):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[3] *= 20.0                                  # an outlier row: its blocks get larger scales
    q, scale = quantize(w, dtype, n, block)
    assert q.dtype == dtype and scale.dtype == np.float32
    assert scale.shape == scale_shape(shape, n, block)
    rows = int(np.prod(shape[:n]))
    w2 = w.reshape(rows, -1)
    top = 127.0 if dtype == np.int8 else 448.0
    np.testing.assert_allclose(scale.reshape(scale.shape[0], -1), _numpy_scales(w2, block, top),
                               rtol=1e-6)
    back = np.asarray(dequantize(q, scale, n, block, np.float32, xp=np)).reshape(rows, -1)
    per_row = np.repeat(scale.reshape(scale.shape[0], -1), rows if block is None else block, 0)[:rows]
    if dtype == np.int8:   # round to nearest: within half a step
        assert np.all(np.abs(back - w2) <= 0.5 * per_row + 1e-6)
        assert np.abs(q).max() == 127
    else:                  # e4m3 has 3 mantissa bits: relative error <= 2^-4 above the subnormals
        normal = np.abs(w2) / per_row >= 2.0 ** -6
        assert np.all(np.abs(back - w2)[normal] <= 2.0 ** -4 * np.abs(w2)[normal] + 1e-7)
        assert not np.isnan(back).any()
    # jax.numpy gives the same values (XLA may divide by a reciprocal: an ulp apart).
    qj, sj = quantize(jnp.asarray(w), dtype, n, block, xp=jnp)
    np.testing.assert_array_equal(np.asarray(qj).view(np.uint8), q.view(np.uint8))
    np.testing.assert_allclose(np.asarray(sj), scale, rtol=1e-6)


def test_all_zero_blocks_and_overflow_do_not_make_nan():
    w = np.zeros((8, 4), np.float32)
    w[:, 1] = 1e6                                 # far beyond fp8's range: the scale takes it
    for dtype in (np.dtype(np.int8), FP8):
        q, scale = quantize(w, dtype, 1, None)
        back = np.asarray(dequantize(q, scale, 1, None, np.float32, xp=np))
        assert np.isfinite(back).all()
        np.testing.assert_allclose(back, w, rtol=2.0 ** -4)
        assert scale[0, 0] == 1.0                 # an all-zero column keeps scale 1


@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("shape,n", [((48, 4, 8), 1), ((4, 12, 40), 2)])
def test_quantized_matmul_is_the_matmul_of_the_dequantized_kernel(shape, n, block):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((5, *shape[:n])).astype(np.float32)
    for dtype in (np.dtype(np.int8), FP8):
        q, scale = quantize(w, dtype, n, block)
        got = quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), n, block, jnp.float32)
        deq = np.asarray(dequantize(jnp.asarray(q), jnp.asarray(scale), n, block, jnp.float32))
        want = np.tensordot(x, deq, axes=n)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
        # ... and close to the float matmul (loose: the quantization error itself).
        np.testing.assert_allclose(np.asarray(got), np.tensordot(x, w, axes=n), rtol=0.1, atol=0.5)


@pytest.mark.parametrize("shape,n", [((48, 4, 8), 1), ((4, 12, 40), 2)])
def test_dynamic_activations_multiply_quantized_rows(shape, n):
    """w8a8: each token quantized with its own scale, the product in the weights' dtype
    (int8 accumulates exactly in int32) -- the matmul of the dequantized operands."""
    from models.quantization import quantize_rows
    rng = np.random.default_rng(2)
    w = rng.standard_normal(shape).astype(np.float32)
    x = rng.standard_normal((5, *shape[:n])).astype(np.float32)
    x[1] *= 30.0                                   # rows keep their own scales
    for dtype in (np.dtype(np.int8), FP8):
        q, scale = quantize(w, dtype, n, None)
        got = quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), n, None,
                               jnp.float32, dynamic_activations=True)
        xq, xs = quantize_rows(jnp.asarray(x.reshape(5, -1)), dtype)
        x_deq = np.asarray(xq).astype(np.float32) * np.asarray(xs)
        deq = np.asarray(dequantize(jnp.asarray(q), jnp.asarray(scale), n, None, jnp.float32))
        want = x_deq @ deq.reshape(x_deq.shape[1], -1)
        np.testing.assert_allclose(np.asarray(got).reshape(5, -1), want, rtol=1e-5, atol=1e-4)
        full = np.tensordot(x, w, axes=n).reshape(5, -1)
        err = np.abs(np.asarray(got).reshape(5, -1) - full).max(axis=1)
        assert (err < 0.15 * np.abs(full).max(axis=1)).all(), err
    with pytest.raises(ValueError, match="per-output-channel"):
        q, scale = quantize(w, np.dtype(np.int8), n, 16)
        quantized_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale), n, 16, jnp.float32,
                         dynamic_activations=True)


def test_quantization_flag_must_match_a_quantized_checkpoint():
    ckpt = WeightQuant("fp8", block_in=128, block_out=128)
    assert resolve_weight_quant(None, ckpt) == ckpt
    assert resolve_weight_quant("fp8", ckpt) == ckpt
    with pytest.raises(ValueError, match="already fp8-quantized"):
        resolve_weight_quant("int8", ckpt)
    assert resolve_weight_quant("int8", None) == WeightQuant("int8")
    assert resolve_weight_quant(None, None) is None
    assert resolve_weight_quant("fp8", None, "dynamic") == WeightQuant("fp8", dynamic_activations=True)
    with pytest.raises(ValueError, match="needs --quantization"):
        resolve_weight_quant(None, None, "dynamic")
    with pytest.raises(ValueError, match="per-output-channel weights"):
        resolve_weight_quant(None, ckpt, "dynamic")


def test_unsupported_checkpoint_quantization_is_refused():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    for qc, match in (({"quant_method": "awq"}, "quant_method='awq'"),
                      ({"quant_method": "fp8", "activation_scheme": "static",
                        "weight_block_size": [128, 128]}, "activation_scheme"),
                      ({"quant_method": "fp8"}, "weight_block_size")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_dict({**base, "quantization_config": qc})


# ---- FP8 block checkpoints ------------------------------------------------------

# Blocks that divide none of the tiny models' dims (64, 128, 32, 16...): partial blocks
# at every edge.
BLOCK = (24, 40)
PAGE, NUM_PAGES, SLOTS = 16, 24, 4


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    made = {}

    def get(kind: str) -> tuple[str, str]:
        if kind not in made:
            src = make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind))
            made[kind] = make_fp8_block_checkpoint(src, tmp_path_factory.mktemp(kind + "_fp8"),
                                                   tmp_path_factory.mktemp(kind + "_deq"), BLOCK)
        return made[kind]
    return get


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "qwen3_5_moe"])
def test_fp8_block_checkpoint_logits_match_transformers_on_dequantized_weights(kind, fp8_checkpoints):
    fp8_dir, deq_dir = fp8_checkpoints(kind)
    cfg = ModelConfig.from_pretrained(fp8_dir)
    assert cfg.weight_quant == WeightQuant("fp8", block_in=BLOCK[1], block_out=BLOCK[0])
    model = build_model(cfg, jnp.float32)
    params = load_params(fp8_dir, cfg, model, jnp.float32)
    # Served as stored: the float8 values themselves, not a float copy.
    q_proj = params["layers_0"]["self_attn" if not cfg.is_hybrid else "linear_attn"]
    kernel = q_proj["q_proj" if not cfg.is_hybrid else "in_proj_qkv"]["kernel"]
    assert kernel.dtype == jnp.float8_e4m3fn
    shapes = cache_shapes(cfg, num_pages=NUM_PAGES, page_size=PAGE, kv_dtype=jnp.float32,
                          num_state_slots=SLOTS, conv_state_dtype=jnp.float32)
    caches = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
    toks = prompt(70, seed=3)
    inputs, _ = make_inputs([(toks, 0, list(range(1, 6)))], page_size=PAGE, num_tokens=96,
                            num_rows=2, pages_per_row=8, state_slots=[1] if cfg.is_hybrid else None)
    hidden, _ = jax.jit(model.apply)({"params": params}, caches, inputs)
    got = np.asarray(model.apply({"params": params}, hidden, method="compute_logits"))[:len(toks)]
    ref = model_class(kind).from_pretrained(deq_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor(toks, dtype=torch.long)[None]).logits[0].float().numpy()
    assert_close(got, want)


# One kind (the engine + transformers take ~70 s a kind): the hybrid MoE holds every
# quantized layer type; the logits test above covers the others.
@pytest.mark.parametrize("kind", ["qwen3_5_moe"])
def test_fp8_block_checkpoint_served_gives_transformers_greedy_tokens(kind, fp8_checkpoints):
    from jaxserve import LLM, SamplingParams
    from tests.checkpoints import reference_greedy

    fp8_dir, deq_dir = fp8_checkpoints(kind)
    prompts = [[int(t) for t in prompt(n, seed=n)] for n in (9, 40)]
    # A 64-token step holds both prompts (49 tokens), as the default 2048 did; numerics
    # only: no warmup, the programs the two greedy requests use compile when first used.
    llm = LLM(fp8_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              enforce_eager=True)
    assert llm.engine.info.model_config.weight_quant.block_in == BLOCK[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == reference_greedy(deq_dir, prompts, 8, kind)
