"""jaxserve models vs transformers on the same tiny safetensors files (float32)."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from models.config import ModelConfig
from models.layer_stack import cache_shapes
from models.registry import build_model
from models.weights import load_params, untie_lm_head
from tests.checkpoints import make_tiny_checkpoint
from tests.models.batch_util import make_inputs

KINDS = ["llama", "qwen3", "qwen3_moe"]
PAGE = 16
NUM_PAGES = 24
T_PAD, R_PAD, P_PAD = 96, 4, 8   # one static shape per model: one compile


class Loaded:
    """A checkpoint loaded by both jaxserve and transformers."""

    def __init__(self, path: str, scan_layers: bool = False):
        self.path = path
        self.cfg = ModelConfig.from_pretrained(path)
        self.model = build_model(self.cfg, jnp.float32, scan_layers=scan_layers)
        self.params = load_params(path, self.cfg, self.model, jnp.float32)
        self.apply = jax.jit(self.model.apply)
        self.logits_fn = jax.jit(lambda p, h: self.model.apply({"params": p}, h, method="compute_logits"))
        self.torch = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def caches(self) -> dict[str, jax.Array]:
        shapes = cache_shapes(self.cfg, num_pages=NUM_PAGES, page_size=PAGE, kv_dtype=jnp.float32,
                              num_state_slots=0, conv_state_dtype=jnp.float32)
        return {kind: jnp.zeros(s.shape, s.dtype) for kind, s in shapes.items()}

    def step(self, caches, seqs):
        """seqs: list of (new_tokens, num_computed, pages). Returns per-seq logits, caches."""
        inputs, spans = make_inputs(seqs, page_size=PAGE, num_tokens=T_PAD, num_rows=R_PAD,
                                    pages_per_row=P_PAD)
        hidden, caches = self.apply({"params": self.params}, caches, inputs)
        logits = np.asarray(self.logits_fn(self.params, hidden))
        return [logits[a:b] for a, b in spans], caches

    def torch_logits(self, tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.torch(torch.tensor(tokens, dtype=torch.long)[None]).logits[0].float().numpy()


def assert_close(got, want, rel=1e-4):
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert err < rel * scale, f"max abs diff {err} (logit scale {scale})"


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 256, n)


def shuffled_pages(n: int, seed: int) -> list[int]:
    return [int(p) for p in np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES))[:n]]


@pytest.fixture(scope="module", params=[False, True], ids=["layer_loop", "scan_layers"])
def loaded(request, tmp_path_factory):
    """Every test runs on the Python layer loop and on the scanned layers."""
    cache: dict[str, Loaded] = {}

    def get(kind: str) -> Loaded:
        if kind not in cache:
            cache[kind] = Loaded(make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind)),
                                 scan_layers=request.param)
        return cache[kind]
    return get


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_matches_transformers(loaded, kind):
    m = loaded(kind)
    toks = prompt(70, seed=1)   # 70 tokens: 5 pages of 16, in shuffled order
    (logits,), _ = m.step(m.caches(), [(toks, 0, shuffled_pages(5, seed=2))])
    assert logits.shape == (70, m.cfg.vocab_size) and logits.dtype == np.float32
    assert_close(logits, m.torch_logits(toks))


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_and_decode_equal_full_forward(loaded, kind):
    m = loaded(kind)
    toks = prompt(76, seed=3)
    pages = shuffled_pages(5, seed=4)
    (full,), _ = m.step(m.caches(), [(toks, 0, pages)])
    assert_close(full, m.torch_logits(toks))

    caches, done = m.caches(), 0
    for n in [30, 25, 15, 1, 1, 1, 1, 1, 1]:   # three prefill chunks, six decode steps
        (logits,), caches = m.step(caches, [(toks[done:done + n], done, pages)])
        assert_close(logits, full[done:done + n], rel=1e-5)
        done += n
    assert done == 76


@pytest.mark.parametrize("kind", KINDS)
def test_packed_batch_equals_each_alone(loaded, kind):
    m = loaded(kind)
    a, b = prompt(40, seed=5), prompt(50, seed=6)
    pages = shuffled_pages(8, seed=7)
    pa, pb = pages[:3], pages[3:7]
    (alone_a,), _ = m.step(m.caches(), [(a, 0, pa)])
    (alone_b,), _ = m.step(m.caches(), [(b, 0, pb)])
    (got_a, got_b), caches = m.step(m.caches(), [(a[:24], 0, pa), (b, 0, pb)])
    assert_close(got_a, alone_a[:24], rel=1e-5)
    assert_close(got_b, alone_b, rel=1e-5)
    # Next step mixes a prefill chunk (a) and a decode (b, one more token).
    nxt = np.array([7])
    (got_a, got_b1), _ = m.step(caches, [(a[24:], 24, pa), (nxt, 50, pb)])
    assert_close(got_a, alone_a[24:], rel=1e-5)
    assert_close(got_b1, m.torch_logits(np.concatenate([b, nxt]))[-1:])


def test_moe_dense_layers_and_no_renormalisation(tmp_path):
    """mlp_only_layers / decoder_sparse_step give dense layers; norm_topk_prob False."""
    path = make_tiny_checkpoint("qwen3_moe", tmp_path, num_hidden_layers=4, mlp_only_layers=[0],
                                decoder_sparse_step=2, norm_topk_prob=False)
    m = Loaded(path)
    assert [m.cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert "experts" in m.params["layers_1"]["mlp"] and "up_proj" in m.params["layers_2"]["mlp"]
    toks = prompt(40, seed=8)
    (logits,), _ = m.step(m.caches(), [(toks, 0, shuffled_pages(3, seed=9))])
    assert_close(logits, m.torch_logits(toks))


@pytest.mark.parametrize("tied", [True, False])
def test_llama_tied_and_untied(tmp_path, tied):
    path = make_tiny_checkpoint("llama", tmp_path, tie_word_embeddings=tied, num_hidden_layers=2)
    with open(Path(path) / "config.json") as f:
        assert json.load(f)["tie_word_embeddings"] is tied
    m = Loaded(path)
    assert ("lm_head" in m.params) is not tied
    toks = prompt(20, seed=10)
    (logits,), _ = m.step(m.caches(), [(toks, 0, shuffled_pages(2, seed=11))])
    assert_close(logits, m.torch_logits(toks))


def test_untied_lm_head_copy_gives_the_tied_logits(tmp_path):
    # The engine on CPU replaces a tied embedding's lm_head by a transposed copy.
    path = make_tiny_checkpoint("qwen3", tmp_path, num_hidden_layers=1)
    m = Loaded(path)
    assert m.cfg.tie_word_embeddings and "lm_head" not in m.params
    untied, params = untie_lm_head(m.model, m.params)
    assert not untied.config.tie_word_embeddings
    emb = np.asarray(m.params["embed_tokens"]["embedding"])
    np.testing.assert_array_equal(np.asarray(params["lm_head"]["kernel"]), emb.T)
    hidden = np.random.default_rng(3).normal(size=(5, m.cfg.hidden_size)).astype(np.float32)
    want = m.logits_fn(m.params, hidden)
    got = untied.apply({"params": params}, hidden, method="compute_logits")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
