"""Speculative decoding with Qwen3.5's MTP layer (method "mtp"): the drafts the engine
proposes equal an independent PyTorch reference built from transformers' own Qwen3.5
modules (the target from the checkpoint's class, the MTP from a transformers decoder
layer, RMSNorms and rotary embedding loaded with the checkpoint's `mtp.*` tensors).

The reference, for a request whose known tokens are x_0 .. x_v (x_v: the bonus, the
token the target sampled last):
  h_t = the target's final-normed hidden state at t (t < v);
  the MTP, a causal sequence at positions 0, 1, ...: row t < v reads
    fc([pre_fc_norm_embedding(embed(x_{t+1})); pre_fc_norm_hidden(h_t)]),
  then the decoder layer, then `norm` -> m_t; d_1 = argmax lm_head(m_{v-1});
  row v - 1 + j (j >= 1) reads (embed(d_j), m_{v-2+j}) -> d_{j+1} = argmax lm_head(m_{v-1+j}).
The MTP rows are recomputed from scratch for every step's snapshot of every request
(the target's hidden states once per request, on its final tokens: the tokens known
after any step are a prefix of them), so the engine's incremental drafter (catch-up over
each step's tokens, KV of rejected drafts written over, hybrid rollbacks, chunked
prefill, several rows in a batch, drafts clipped by the token budget) must match it.
Besides the drafts, the drafter's KV cache itself is compared, row by row, with the
reference's K (after k_norm and RoPE) and V: rows 0 .. v - 1 (the catch-ups) and
v .. v + k - 2 (the draft steps).

Each engine draft is compared teacher-forced (the reference reads the engine's earlier
drafts): its reference logit must be within LOGIT_TOL of the reference maximum, so a
near-tie cannot fail the test, and most drafts must be decisive (the top-2 gap wider
than LOGIT_TOL), where that means the exact argmax.

After a prefix hit the drafter's KV is checked too: a hit leaves out its last page,
whose last row depends on the token after it.
"""
from __future__ import annotations

import copy
import importlib
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from tests.checkpoints import add_mtp_layer, make_tiny_checkpoint, model_class
from tests.engine.conftest import add, assert_no_leaks

LOGIT_TOL = 1e-4     # float32 logits of jax and torch agree to ~1e-5
KV_TOL = 1e-4        # the drafter's KV cache entries against the reference's (|K| ~ 5)
K = 3                # num_speculative_tokens
# enforce_eager: no warmup (CPU compiles are slow), a program compiles when first run; a
# 16-token budget: one token bucket, prompts prefilled in chunks of 16, drafts clipped.
ENGINE_KW = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                 compilation_cache_dir=None, enforce_eager=True,
                 speculative_config={"method": "mtp", "num_speculative_tokens": K})


# ---- the PyTorch reference -------------------------------------------------------------
def _fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (mlp.experts.{e}.{gate,up,down}_proj.weight) ->
    transformers' fused 3D parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj)."""
    experts = sorted({int(k.split(".")[2]) for k in sd if k.startswith("mlp.experts.")})
    if not experts:
        return sd
    out = {k: v for k, v in sd.items() if not k.startswith("mlp.experts.")}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [sd[f"mlp.experts.{e}.gate_proj.weight"], sd[f"mlp.experts.{e}.up_proj.weight"]], 0)
        for e in experts])
    out["mlp.experts.down_proj"] = torch.stack(
        [sd[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    return out


class TorchMTPReference:
    """The target (transformers, from the checkpoint) and its MTP layer (transformers'
    decoder layer of the first full-attention index, its RMSNorm and rotary embedding)."""

    def __init__(self, path: str, kind: str):
        from safetensors.torch import load_file
        model = model_class(kind).from_pretrained(path, dtype=torch.float32).eval()
        self.lm = model.model.language_model          # final-normed last_hidden_state
        self.lm_head = model.lm_head
        cfg = copy.deepcopy(model.config.text_config)
        cfg._attn_implementation = "eager"             # the explicit causal mask below
        mod = importlib.import_module(type(model).__module__)
        pre = "Qwen3_5Moe" if kind == "qwen3_5_moe" else "Qwen3_5"
        layer_cls, norm_cls = getattr(mod, pre + "DecoderLayer"), getattr(mod, pre + "RMSNorm")
        rope_cls = getattr(mod, pre + "TextRotaryEmbedding")
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        tensors = load_file(str(Path(path) / "model.safetensors"))
        mtp = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
        assert mtp, "the checkpoint has no mtp.* tensors"
        self.layer = layer_cls(cfg, cfg.layer_types.index("full_attention")).eval()
        self.layer.load_state_dict(_fuse_experts(
            {k[len("layers.0."):]: v for k, v in mtp.items() if k.startswith("layers.0.")}),
            strict=True)
        self.fc = torch.nn.Linear(2 * e, e, bias=False)
        self.fc.weight.data.copy_(mtp["fc.weight"])
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            n = norm_cls(e, eps=eps)            # (1 + w) * x / rms(x)
            n.weight.data.copy_(mtp[f"{name}.weight"])
            self.norms[name] = n
        self.rope = rope_cls(cfg)
        self.apply_rope = mod.apply_rotary_pos_emb
        used = {"fc.weight"} | {f"{n}.weight" for n in self.norms} | \
            {k for k in mtp if k.startswith("layers.0.")}
        assert used == set(mtp), set(mtp) - used

    def embed(self, ids) -> torch.Tensor:
        return self.lm.embed_tokens(torch.as_tensor(ids, dtype=torch.long))

    def target_hidden(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), E]: the target's final-normed hidden state at each position."""
        out = self.lm(input_ids=torch.tensor([tokens]), use_cache=False)
        return out.last_hidden_state[0]

    def mtp(self, embeds: torch.Tensor, hidden: torch.Tensor, with_kv: bool = False):
        """The MTP over a causal sequence: row t (position t) reads embeds[t], hidden[t]
        -> its output [T, E] (with_kv: and the layer's K and V [T, kv heads, head dim],
        K after its norm and RoPE, as a KV cache holds them)."""
        n = self.norms
        x = self.fc(torch.cat([n["pre_fc_norm_embedding"](embeds),
                               n["pre_fc_norm_hidden"](hidden)], -1))[None]
        t = x.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        cos_sin = self.rope(x, pos)
        y = n["norm"](self.layer(x, position_embeddings=cos_sin, attention_mask=mask,
                                 position_ids=pos))[0]
        if not with_kv:
            return y
        attn = self.layer.self_attn
        a = self.layer.input_layernorm(x)
        k = attn.k_norm(attn.k_proj(a).view(1, t, -1, attn.head_dim)).transpose(1, 2)
        _, k = self.apply_rope(k, k, *cos_sin)
        v = attn.v_proj(a).view(t, -1, attn.head_dim)
        return y, k[0].transpose(0, 1), v

    @torch.inference_mode()
    def check_drafts(self, tokens: list[int], drafts: list[int], target_hidden: torch.Tensor
                     ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """tokens: x_0 .. x_v (x_v the bonus); drafts: the engine's d_1 .. d_k;
        target_hidden: h_0 .. h_{v-1} at least. -> (the reference logits of each draft,
        teacher-forced on the engine's earlier drafts; K and V of the MTP rows the drafter
        computed: 0 .. v - 1 in its catch-ups, v .. v + k - 2 in its draft steps)."""
        v = len(tokens) - 1
        embeds = list(self.embed(tokens[1:]))           # rows 0 .. v - 1: embed(x_{t+1})
        hidden = list(target_hidden[:v])                 # and h_t
        logits = []
        for d in drafts:
            m = self.mtp(torch.stack(embeds), torch.stack(hidden))
            logits.append(self.lm_head(m[-1]).numpy().astype(np.float64))
            embeds.append(self.embed([d])[0])            # the next step reads the draft
            hidden.append(m[-1])                         # and the MTP's output hidden state
        n = v + len(drafts) - 1                          # the last draft's row is not run
        _, k, vv = self.mtp(torch.stack(embeds[:n]), torch.stack(hidden[:n]), with_kv=True)
        return logits, k.numpy(), vv.numpy()


# ---- the checkpoint and the engine ------------------------------------------------------
def _make_checkpoint(kind: str, path: Path) -> str:
    """A tiny Qwen3.5 with an MTP layer that drafts well enough for some drafts to be
    accepted (random ones never are): fc passes the embedding of the next token through
    (plus noise 0.05 on both halves, so the hidden half matters too), its norm is the
    target's final norm; the decoder layer stays random. Its greedy drafts then often
    predict the target's token after next, so steps accept all, some or none of them."""
    from safetensors.torch import load_file, save_file
    path = add_mtp_layer(make_tiny_checkpoint(kind, path))
    file = Path(path) / "model.safetensors"
    t = load_file(str(file))
    e = t["mtp.fc.weight"].shape[0]
    gen = torch.Generator().manual_seed(3)
    t["mtp.fc.weight"] = torch.cat([torch.eye(e), torch.zeros(e, e)], 1) + \
        0.05 * torch.randn(e, 2 * e, generator=gen)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(e)
    t["mtp.norm.weight"] = t["model.language_model.norm.weight"].clone()
    save_file(t, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=("qwen3_5", "qwen3_5_moe"))
def setup(request, tmp_path_factory):
    kind = request.param
    path = _make_checkpoint(kind, tmp_path_factory.mktemp(f"mtp_{kind}"))
    return kind, TorchMTPReference(path, kind), LLM(path, **ENGINE_KW).engine


def _snapshot(engine, req) -> dict:
    """What the engine holds for a request after a step: its known tokens, the drafts
    for its next step and the drafter's KV of positions 0 .. v + K - 2 (v: the bonus's
    position), K and V each [positions, kv heads, head dim] (the cache's layout:
    [pages, 2 * kv heads, page size, head dim], K and V of kv head h at 2h and 2h + 1,
    pallas_kernels/ragged_paged_attention/cache.py)."""
    tokens, drafts = list(req.all_token_ids), list(req.spec_token_ids)
    n = len(tokens) - 1 + len(drafts) - 1
    cache = np.asarray(engine.runner.drafter.caches["kv"])
    ps = cache.shape[2]
    pages = engine.scheduler.kv.get_page_ids(req.request_id)
    rows = np.stack([cache[pages[p // ps], :, p % ps, :] for p in range(n)])
    return dict(tokens=tokens, drafts=drafts, k=rows[:, 0::2], v=rows[:, 1::2])


class _Tally:
    def __init__(self):
        self.drafts = self.decisive = self.kv_rows = 0


def _check(ref: TorchMTPReference, snap: dict, target_hidden: torch.Tensor, tally: _Tally,
           where: str) -> None:
    """A snapshot's drafts and drafter KV against the reference on its known tokens."""
    tokens, drafts = snap["tokens"], snap["drafts"]
    v = len(tokens) - 1
    assert len(drafts) == K, (where, drafts)
    logits, rk, rv = ref.check_drafts(tokens, drafts, target_hidden)
    for j, (d, lg) in enumerate(zip(drafts, logits)):
        top2 = np.sort(lg)[-2:]
        tally.drafts += 1
        tally.decisive += bool(top2[1] - top2[0] > LOGIT_TOL)
        assert lg[d] >= top2[1] - LOGIT_TOL, (
            f"{where}: draft {j + 1} is {d} (reference logit {lg[d]:.6f}), the reference's "
            f"argmax is {int(lg.argmax())} ({top2[1]:.6f}); known tokens {tokens}, engine "
            f"drafts {drafts}")
    bad = np.flatnonzero((np.abs(snap["k"] - rk).max(axis=(1, 2)) > KV_TOL)
                         | (np.abs(snap["v"] - rv).max(axis=(1, 2)) > KV_TOL))
    assert not len(bad), (f"{where}: the drafter's KV differs from the reference at positions "
                          f"{bad.tolist()} (the bonus at {v}); known tokens {tokens}")
    tally.kv_rows += len(rk)


# ---- the tests --------------------------------------------------------------------------
def test_mtp_drafts_match_torch_reference(setup):
    """Three requests, staggered, with chunked prefills and a token budget that clips
    some steps' drafts: after every step, every request's drafts and the drafter's KV
    cache equal the reference's on its known tokens (so the catch-up over accepted and
    rejected drafts, and over chunk boundaries, is right); the greedy outputs are the
    target's own argmax. (The target's hidden states are computed once per request, on
    its final tokens: the tokens known after any step are a prefix of them.)"""
    kind, ref, engine = setup
    rng = random.Random(0)
    lens = {"a": 40, "b": 7, "c": 23}
    prompts = {rid: [rng.randrange(3, 256) for _ in range(n)] for rid, n in lens.items()}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    snaps: dict[str, list[tuple[int, dict]]] = {rid: [] for rid in prompts}
    outputs: dict[str, list[int]] = {}
    add(engine, "a", prompts["a"], params)
    add(engine, "b", prompts["b"], params)
    for step in range(1, 200):
        if step == 4:
            add(engine, "c", prompts["c"], params)
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
        for rid, req in engine.scheduler.requests.items():
            if req.spec_token_ids:
                snaps[rid].append((step, _snapshot(engine, req)))
        if len(outputs) == len(prompts):
            break
    assert_no_leaks(engine)
    stats = engine.scheduler.stats()
    tally = _Tally()
    with torch.inference_mode():
        for rid, out in outputs.items():
            seq = prompts[rid] + out
            assert len(out) == params.max_tokens
            hidden = ref.target_hidden(seq[:-1])
            # The outputs are the target's greedy tokens (the drafts changed nothing).
            logits = ref.lm_head(hidden).numpy()[len(prompts[rid]) - 1:]
            picked = logits[np.arange(len(out)), out]
            assert np.all(picked >= logits.max(axis=1) - LOGIT_TOL), (rid, out)
            assert snaps[rid], rid
            for step, snap in snaps[rid]:
                assert seq[:len(snap["tokens"])] == snap["tokens"]
                _check(ref, snap, hidden, tally, f"{kind} step {step} request {rid}")
    print(f"{kind}: {tally.drafts} drafts compared ({tally.decisive} decisive), "
          f"{tally.kv_rows} KV rows; drafted {stats.spec_num_draft_tokens}, accepted "
          f"{stats.spec_num_accepted_tokens}, per position {stats.spec_accepted_per_pos}")
    assert tally.decisive >= 0.9 * tally.drafts > 0
    # Some drafts were accepted and some rejected, some steps accepted part of them.
    acc = stats.spec_accepted_per_pos
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert 0 < acc[0] < stats.spec_num_drafts and acc[-1] < acc[0], acc


def test_mtp_kv_after_prefix_cache_hit(setup):
    """A request whose prompt shares A's first two pages but then differs: the drafter's
    row at 31 reads the token at 32, which the pages' hashes do not cover, so the hit
    leaves out its last page (as vLLM does for EAGLE/MTP) and that row is computed
    with B's own token."""
    kind, ref, engine = setup
    rng = random.Random(1)
    prompt = [rng.randrange(3, 256) for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    add(engine, "A", prompt, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = list(o.outputs[0].token_ids) if o.finished else out
    other = 3 + (out[0] + 7) % 250           # any token but A's token 32
    add(engine, "B", prompt + [other, 5], params)
    while not engine.scheduler.requests["B"].spec_token_ids:
        engine.step()
    req = engine.scheduler.requests["B"]
    assert req.num_cached_tokens == 16       # two cached pages, the last one left out
    snap = _snapshot(engine, req)
    with torch.inference_mode():
        hidden = ref.target_hidden(snap["tokens"][:-1])
    _check(ref, snap, hidden, _Tally(), f"{kind} after a 32-token prefix hit")


def test_mtp_kv_after_a_host_tier_hit(setup):
    """The same hit after A's pages went to the prefix cache's host tier (a device pool
    of 8 pages, which the requests after A fill): it comes back from host, leaves out its
    last page as a device hit does, and the drafter's KV, restored with the target's pages,
    is the reference's."""
    kind, ref, plain = setup
    engine = LLM(plain.config.model, kv_offloading_size=0.02, num_gpu_blocks_override=9,
                 **{**ENGINE_KW, "max_model_len": 128}).engine
    rng = random.Random(1)
    prompt = [rng.randrange(3, 256) for _ in range(64)]   # (16 tokens: recomputed)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = None
    for rid, tokens in [("A", prompt)] + [(f"fill{i}", [rng.randrange(3, 256) for _ in
                                                         range(90)]) for i in range(2)]:
        add(engine, rid, tokens, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                out = list(o.outputs[0].token_ids) if o.request_id == "A" and o.finished else out
    assert engine.stats().host.pages_offloaded >= 2
    other = 3 + (out[0] + 7) % 250
    add(engine, "B", prompt + [other, 5], params)
    while not engine.scheduler.requests["B"].spec_token_ids:
        engine.step()
    req = engine.scheduler.requests["B"]
    assert req.num_cached_tokens == 48       # from host: the last page left out
    assert engine.stats().host.pages_restored == 3
    snap = _snapshot(engine, req)
    with torch.inference_mode():
        hidden = ref.target_hidden(snap["tokens"][:-1])
    _check(ref, snap, hidden, _Tally(), f"{kind} after a 64-token host tier hit")
