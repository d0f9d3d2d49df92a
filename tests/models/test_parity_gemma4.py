"""Gemma 4 text models vs transformers on the same safetensors file, float32 logits:
every variant (sliding + global layers with their own head dims, K = V global layers,
the MoE block beside the MLP, per-layer embeddings with KV-sharing layers, a
vision-language checkpoint's text model), layer loop and scanned layers, over prompts
several windows long, cached decoding and a ragged step mixing prefill chunks and a
decode."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.config import ModelConfig
from models.layer_stack import cache_shapes
from models.registry import build_model
from models.weights import load_params
from tests.checkpoints import GEMMA4_KINDS, make_tiny_checkpoint, model_class
from tests.models.batch_util import make_inputs
from tests.models.test_parity import assert_close, prompt

PAGE, NUM_PAGES = 16, 40
T_PAD, R_PAD, P_PAD = 128, 4, 8


class Gemma:
    def __init__(self, path: str, kind: str, scan_layers: bool):
        self.cfg = ModelConfig.from_pretrained(path)
        assert self.cfg.is_gemma4 and self.cfg.sliding_window == 8
        self.model = build_model(self.cfg, jnp.float32, scan_layers=scan_layers)
        self.params = load_params(path, self.cfg, self.model, jnp.float32)
        self.apply = jax.jit(self.model.apply)
        self.logits_fn = jax.jit(lambda p, h: self.model.apply({"params": p}, h,
                                                               method="compute_logits"))
        self.torch = model_class(kind).from_pretrained(path, dtype=torch.float32).eval()

    def caches(self):
        shapes = cache_shapes(self.cfg, num_pages=NUM_PAGES, page_size=PAGE, kv_dtype=jnp.float32,
                              num_state_slots=0, conv_state_dtype=jnp.float32)
        return {kind: jnp.zeros(s.shape, s.dtype) for kind, s in shapes.items()}

    def step(self, caches, seqs):
        inputs, spans = make_inputs(seqs, page_size=PAGE, num_tokens=T_PAD, num_rows=R_PAD,
                                    pages_per_row=P_PAD)
        hidden, caches = self.apply({"params": self.params}, caches, inputs)
        logits = np.asarray(self.logits_fn(self.params, hidden))
        return [logits[a:b] for a, b in spans], caches

    def torch_logits(self, tokens) -> np.ndarray:
        with torch.no_grad():
            ids = torch.tensor(np.asarray(tokens), dtype=torch.long)[None]
            return self.torch(input_ids=ids).logits[0].numpy()


@pytest.fixture(scope="module", params=[(k, s) for k in GEMMA4_KINDS for s in (False, True)],
                ids=[f"{k}-{'scan_layers' if s else 'layer_loop'}" for k in GEMMA4_KINDS
                     for s in (False, True)])
def gemma(request, tmp_path_factory):
    kind, scan = request.param
    return Gemma(make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind)), kind, scan)


def test_prefill_and_cached_decode_match_transformers(gemma):
    toks = prompt(45, seed=1)     # more than five windows of 8
    pages = [3, 1, 7, 2]
    caches = gemma.caches()
    (got,), caches = gemma.step(caches, [(toks, 0, pages)])
    want = gemma.torch_logits(toks)
    assert_close(got, want)
    seq = list(toks)
    for _ in range(3):
        nxt = int(np.argmax(want[-1]))
        (got,), caches = gemma.step(caches, [([nxt], len(seq), pages)])
        seq.append(nxt)
        want = gemma.torch_logits(seq)
        assert_close(got[0], want[-1])


def test_mixed_ragged_step_matches_transformers(gemma):
    a, b, c = prompt(50, seed=2), prompt(21, seed=3), prompt(5, seed=4)
    pa, pb, pc = [1, 2, 3, 4], [5, 6], [9]
    caches = gemma.caches()
    _, caches = gemma.step(caches, [(a[:19], 0, pa), (b, 0, pb)])
    b_next = int(np.argmax(gemma.torch_logits(b)[-1]))
    (gc, ga, gb), caches = gemma.step(caches, [(c, 0, pc), (a[19:], 19, pa), ([b_next], 21, pb)])
    assert_close(gc, gemma.torch_logits(c))
    assert_close(ga, gemma.torch_logits(a)[19:])
    assert_close(gb[0], gemma.torch_logits(list(b) + [b_next])[-1])


_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj",
              "mlp.down_proj", "experts.gate_up_proj", "experts.down_proj")


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_weights_match_transformers_on_dequantized_weights(method, tmp_path):
    """--quantization on Gemma 4 (attention, dense MLP and the experts, one scale per
    output channel; router, per-layer-embedding projections and embeddings kept): the
    logits equal transformers' on the same weights quantized and dequantized."""
    import shutil
    from dataclasses import replace

    from safetensors.numpy import load_file, save_file

    from models.config import WeightQuant
    from models.quantization import dequantize, quantize, storage_dtype
    kind = "gemma4_moe"
    src = make_tiny_checkpoint(kind, tmp_path / "src")
    quant = WeightQuant(method)
    deq = tmp_path / "deq"
    shutil.copytree(src, deq)
    tensors = load_file(f"{src}/model.safetensors")
    for name, w in tensors.items():
        if any(f".{p}" in name for p in _QUANTIZED):
            rows = w.reshape(-1, *w.shape[-2:])              # [experts or 1, out, in]
            rows = np.stack([dequantize(*quantize(r.T, storage_dtype(quant), 1, None), 1, None,
                                        np.float32).T for r in rows])
            tensors[name] = rows.reshape(w.shape).astype(w.dtype)
    save_file(tensors, f"{deq}/model.safetensors", metadata={"format": "pt"})

    cfg = replace(ModelConfig.from_pretrained(src), weight_quant=quant)
    model = build_model(cfg, jnp.float32)
    params = load_params(src, cfg, model, jnp.float32)
    assert params["layers_0"]["experts"]["gate_proj"].dtype == storage_dtype(quant)
    shapes = cache_shapes(cfg, num_pages=NUM_PAGES, page_size=PAGE, kv_dtype=jnp.float32,
                          num_state_slots=0, conv_state_dtype=jnp.float32)
    caches = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
    toks = prompt(45, seed=6)
    inputs, _ = make_inputs([(toks, 0, [1, 2, 3])], page_size=PAGE, num_tokens=T_PAD,
                            num_rows=R_PAD, pages_per_row=P_PAD)
    hidden, _ = jax.jit(model.apply)({"params": params}, caches, inputs)
    got = np.asarray(model.apply({"params": params}, hidden, method="compute_logits"))[:len(toks)]
    ref = model_class(kind).from_pretrained(str(deq), dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(toks, dtype=torch.long)[None]).logits[0].numpy()
    assert_close(got, want)
