"""Qwen3.5 hybrids (Gated DeltaNet + gated attention, dense and MoE) vs transformers on
the same vision-language checkpoint (text under model.language_model), float32 logits:
a prompt of several DeltaNet chunks, cached decoding, and a ragged step mixing a fresh
prefill, a continued prefill chunk and a decode whose states live in separate slots."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.config import ModelConfig
from models.layer_stack import KV, cache_shapes
from models.registry import build_model
from models.weights import load_params
from tests.checkpoints import HYBRID_KINDS, make_tiny_checkpoint, model_class
from tests.models.batch_util import make_inputs
from tests.models.test_parity import assert_close, prompt

PAGE, NUM_PAGES, SLOTS = 16, 40, 6
T_PAD, R_PAD, P_PAD = 256, 4, 16


class Hybrid:
    def __init__(self, path: str, kind: str, scan_layers: bool):
        self.cfg = ModelConfig.from_pretrained(path)
        assert self.cfg.is_hybrid and len(self.cfg.full_attention_layers) == 2
        self.model = build_model(self.cfg, jnp.float32, scan_layers=scan_layers)
        self.params = load_params(path, self.cfg, self.model, jnp.float32)
        self.apply = jax.jit(self.model.apply)
        self.logits_fn = jax.jit(lambda p, h: self.model.apply({"params": p}, h, method="compute_logits"))
        self.torch = model_class(kind).from_pretrained(path, dtype=torch.float32).eval()

    def caches(self):
        shapes = cache_shapes(self.cfg, num_pages=NUM_PAGES, page_size=PAGE, kv_dtype=jnp.float32,
                              num_state_slots=SLOTS, conv_state_dtype=jnp.float32)
        # NaN in every state slot: a fresh request must never read its slot's old content.
        return {kind: jnp.zeros(s.shape, s.dtype) if kind == KV else jnp.full(s.shape, jnp.nan, s.dtype)
                for kind, s in shapes.items()}

    def step(self, caches, seqs, slots):
        inputs, spans = make_inputs(seqs, page_size=PAGE, num_tokens=T_PAD, num_rows=R_PAD,
                                    pages_per_row=P_PAD, state_slots=slots)
        hidden, caches = self.apply({"params": self.params}, caches, inputs)
        logits = np.asarray(self.logits_fn(self.params, hidden))
        return [logits[a:b] for a, b in spans], caches

    def torch_logits(self, tokens) -> np.ndarray:
        with torch.no_grad():
            return self.torch(torch.tensor(np.asarray(tokens), dtype=torch.long)[None]).logits[0].numpy()


@pytest.fixture(scope="module", params=[(k, s) for k in HYBRID_KINDS for s in (False, True)],
                ids=[f"{k}-{'scan_layers' if s else 'layer_loop'}" for k in HYBRID_KINDS
                     for s in (False, True)])
def hybrid(request, tmp_path_factory):
    kind, scan = request.param   # two periods of the layer pattern: the scan steps over blocks
    return Hybrid(make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind), num_hidden_layers=8),
                  kind, scan)


def test_prefill_and_cached_decode_match_transformers(hybrid):
    toks = prompt(150, seed=1)                # three DeltaNet chunks of 64
    pages = list(range(1, 12))
    caches = hybrid.caches()
    (got,), caches = hybrid.step(caches, [(toks, 0, pages)], [3])
    want = hybrid.torch_logits(toks)
    assert_close(got, want)
    # Decode three tokens from the cache and the slot's state.
    seq = list(toks)
    for _ in range(3):
        nxt = int(np.argmax(want[-1]))
        (got,), caches = hybrid.step(caches, [([nxt], len(seq), pages)], [3])
        seq.append(nxt)
        want = hybrid.torch_logits(seq)
        assert_close(got[0], want[-1])


def test_mixed_ragged_step_matches_transformers(hybrid):
    a, b, c = prompt(100, seed=2), prompt(70, seed=3), prompt(9, seed=4)
    pa, pb, pc = list(range(1, 9)), list(range(9, 15)), list(range(20, 22))
    caches = hybrid.caches()
    # Step 1: a's first 40 tokens, all of b.
    _, caches = hybrid.step(caches, [(a[:40], 0, pa), (b, 0, pb)], [5, 1])
    b_next = int(np.argmax(hybrid.torch_logits(b)[-1]))
    # Step 2: a continues (60 tokens, state from slot 5), b decodes (slot 1), c starts
    # fresh in slot 2 -- rows in a different order than their slots.
    (ga, gb, gc), caches = hybrid.step(
        caches, [(c, 0, pc), (a[40:], 40, pa), ([b_next], 70, pb)], [2, 5, 1])
    assert_close(ga, hybrid.torch_logits(c))
    assert_close(gb, hybrid.torch_logits(a)[40:])
    assert_close(gc[0], hybrid.torch_logits(list(b) + [b_next])[-1])
