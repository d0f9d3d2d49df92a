"""`python -m jaxserve.plan`: what a model needs on a "DxM" mesh, computed from its config.

    python -m jaxserve.plan --model qwen3-8b --mesh 1x8 --hbm 80GiB

Every figure comes from the model config and the same code the engine runs:
parameter shapes from the flax model (jax.eval_shape, nothing allocated), their
placement from sharding/rules.py (including KV heads replicated when M does not
divide them), the KV page layout of the cache. Nothing here is a hand-typed size
except the built-in configs below, copied from their published config.json.

Memory: the engine's own rule -- the KV cache gets hbm_utilization (0.9) of the
device memory (--hbm) that the weights leave; the rest is the reserve for
activations, XLA's workspace and fragmentation, shown next to an estimate of
one step's activation peak. Communication: Megatron
tensor parallelism all-reduces the [tokens, hidden] activations twice per layer
(after o_proj and after the MLP's down_proj) plus once for the vocab-parallel
embedding; a ring all-reduce moves 2 (M-1)/M of the buffer through every device's
link in each direction.
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

# Published config.json of Qwen/Qwen3-8B (text fields the engine reads).
BUILTIN_CONFIGS: dict[str, dict] = {
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "attention_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
}
# NVLink 4 on an H100 SXM: 18 links x 25 GB/s = 450 GB/s per direction per GPU.
DEFAULT_LINK_GBPS = 450.0
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """"80GiB", "80GB", "85899345920" -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit "
                         f"(B, KB, MB, GB, KiB, MiB, GiB, ...)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def load_model_config(model: str):
    """A built-in alias (qwen3-8b), a checkpoint directory or a config.json path."""
    from models.config import ModelConfig
    if model.lower() in BUILTIN_CONFIGS:
        return ModelConfig.from_hf_dict(BUILTIN_CONFIGS[model.lower()])
    path = Path(model)
    if path.is_dir():
        return ModelConfig.from_pretrained(path)
    if path.is_file():
        with open(path) as f:
            return ModelConfig.from_hf_dict(json.load(f))
    raise ValueError(f"model {model!r}: not a built-in ({', '.join(BUILTIN_CONFIGS)}), "
                     f"a directory or a config.json")


@dataclass(frozen=True)
class Plan:
    model: str
    mesh: tuple[int, int]
    dtype: str
    kv_dtype: str
    num_params: int
    weight_bytes: int                 # one replica, all devices
    weight_bytes_per_device: int
    replicated_param_bytes: int       # of weight_bytes_per_device, held by every device
    kv_heads: int                     # as the model has them
    kv_heads_stored: int              # across the model axis (replicated heads when K % M)
    kv_bytes_per_token_per_device: int
    num_layers: int
    hidden_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    activation_bytes: int             # estimated peak of one step, per device
    hbm_bytes: int | None
    hbm_utilization: float
    link_gbps: float

    @property
    def free_after_weights(self) -> int:
        return max(0, (self.hbm_bytes or 0) - self.weight_bytes_per_device)

    @property
    def kv_budget_bytes(self) -> int:
        """What the engine gives the KV cache: hbm_utilization of what the weights leave."""
        return int(self.free_after_weights * self.hbm_utilization)

    @property
    def reserve_bytes(self) -> int:
        return self.free_after_weights - self.kv_budget_bytes

    @property
    def kv_tokens(self) -> int:
        return self.kv_budget_bytes // self.kv_bytes_per_token_per_device

    @property
    def allreduce_bytes_per_token_per_layer(self) -> int:
        act = _ITEMSIZE[self.dtype]
        return 0 if self.mesh[1] == 1 else 2 * self.hidden_size * act

    def allreduce_seconds(self, nbytes: float) -> float:
        m = self.mesh[1]
        return 0.0 if m == 1 else 2 * (m - 1) / m * nbytes / (self.link_gbps * 1e9)


def make_plan(mc, *, model: str, mesh: str, dtype: str = "auto", kv_cache_dtype: str = "auto",
              max_model_len: int | None = None, max_num_seqs: int = 256,
              max_num_batched_tokens: int | None = None, hbm_bytes: int | None = None,
              hbm_utilization: float = 0.9, link_gbps: float = DEFAULT_LINK_GBPS) -> Plan:
    from flax.traverse_util import flatten_dict

    from jaxserve.config import parse_mesh
    from models.registry import build_model
    from models.weights import abstract_params, param_logical_axes
    from sharding import MODEL, check_model_axis, kv_head_layout, logical_to_mesh, mesh_rules

    d, m = parse_mesh(mesh)
    check_model_axis(mc, m)
    dtype = (mc.dtype if mc.dtype in _ITEMSIZE else "float32") if dtype == "auto" else dtype
    kv_dtype = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    for name, value in (("dtype", dtype), ("kv_cache_dtype", kv_dtype)):
        if value not in _ITEMSIZE:
            raise ValueError(f"{name}={value!r}: expected one of {tuple(_ITEMSIZE)}")
    kv_heads = kv_head_layout(mc.num_heads, mc.num_kv_heads, m)
    module = build_model(replace(mc, num_kv_heads=kv_heads), dtype, "reference")
    shapes = flatten_dict(abstract_params(module))
    axes = flatten_dict(param_logical_axes(module))
    rules = mesh_rules(mc, m)
    per_device = replicated = total = num_params = 0
    for path, sds in shapes.items():
        nbytes = sds.size * _ITEMSIZE[dtype]
        split = m if MODEL in tuple(logical_to_mesh(axes[path], rules)) else 1
        # Replicated KV heads are the same parameters again: count them once.
        unique = sds.size * mc.num_kv_heads // kv_heads if "kv_heads" in tuple(axes[path]) \
            else sds.size
        num_params += unique
        total += unique * _ITEMSIZE[dtype]
        per_device += nbytes // split
        replicated += nbytes if split == 1 else 0
    max_model_len = max_model_len or mc.max_position_embeddings
    tokens = max_num_batched_tokens or max(2048, max_num_seqs)
    kv_tok = mc.num_layers * 2 * (kv_heads // m) * mc.head_dim * _ITEMSIZE[kv_dtype]
    return Plan(
        model=f"{model} ({mc.architecture})", mesh=(d, m), dtype=dtype,
        kv_dtype=kv_dtype, num_params=num_params, weight_bytes=total,
        weight_bytes_per_device=per_device, replicated_param_bytes=replicated,
        kv_heads=mc.num_kv_heads, kv_heads_stored=kv_heads, kv_bytes_per_token_per_device=kv_tok,
        num_layers=mc.num_layers, hidden_size=mc.hidden_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens,
        activation_bytes=activation_bytes(mc, m, tokens, max_num_seqs, dtype),
        hbm_bytes=hbm_bytes, hbm_utilization=hbm_utilization, link_gbps=link_gbps)


def activation_bytes(mc, m: int, tokens: int, rows: int, dtype: str) -> int:
    """Rough peak of one step per device: the widest per-layer temporaries of a token
    bucket (residual + q/k/v + MLP gate/up, split by M where sharded; experts see
    top-k copies of each token) and the sampler's float32 logits [rows, V], gathered
    whole, with about four live copies (softmax, sort, mask)."""
    act = _ITEMSIZE[dtype]
    attn = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim // m
    mlp = 2 * (mc.moe_intermediate_size * mc.num_experts_per_tok if mc.is_moe
               else mc.intermediate_size) // m
    per_token = (3 * mc.hidden_size + attn + mlp) * act
    return tokens * per_token + 4 * rows * mc.vocab_size * 4


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def format_plan(p: Plan) -> str:
    d, m = p.mesh
    lines = [
        f"plan: {p.model} on mesh {d}x{m} ({d} replica{'s' if d > 1 else ''} x {m}-way tensor "
        f"parallel), weights {p.dtype}, KV cache {p.kv_dtype}",
        f"  parameters                 {p.num_params:,} ({p.num_params / 1e9:.2f} B)"
        if p.num_params >= 1e9 else f"  parameters                 {p.num_params:,}",
        f"  weights per replica        {_gib(p.weight_bytes)}",
        f"  weights per device         {_gib(p.weight_bytes_per_device)} "
        f"(of which replicated on every device: {_gib(p.replicated_param_bytes)})",
    ]
    if p.kv_heads_stored != p.kv_heads:
        lines.append(f"  KV heads                   {p.kv_heads} do not divide by {m}: each "
                     f"replicated {p.kv_heads_stored // p.kv_heads}x, "
                     f"{p.kv_heads_stored // m} per device")
    else:
        lines.append(f"  KV heads                   {p.kv_heads}, {p.kv_heads // m} per device")
    lines.append(f"  KV cache per token/device  {p.kv_bytes_per_token_per_device / 2**10:.1f} KiB "
                 f"({p.num_layers} layers x K and V)")
    if p.hbm_bytes:
        seqs = p.kv_tokens // p.max_model_len
        fits = p.max_num_seqs * p.max_model_len <= p.kv_tokens
        lines += [
            f"  device memory              {_gib(p.hbm_bytes)}: weights "
            f"{_gib(p.weight_bytes_per_device)} + reserve {_gib(p.reserve_bytes)} "
            f"({1 - p.hbm_utilization:.0%} of the rest, for activations "
            f"~{_gib(p.activation_bytes)} at "
            f"{p.max_num_batched_tokens} tokens/step, workspace) + KV {_gib(p.kv_budget_bytes)}",
            f"  KV capacity per replica    {p.kv_tokens:,} tokens = {seqs} sequences x "
            f"{p.max_model_len:,} tokens (max_model_len)"
            + (f"; x{d} replicas = {d * p.kv_tokens:,} tokens" if d > 1 else ""),
            f"  max_num_seqs={p.max_num_seqs} x max_model_len={p.max_model_len:,}   "
            + ("fits" if fits else f"does NOT fit: at most {seqs} full-length sequences, or "
               f"{p.kv_tokens // p.max_num_seqs:,} tokens each for {p.max_num_seqs}"),
        ]
        if p.activation_bytes > p.reserve_bytes:
            lines.append(f"  WARNING: estimated activations ({_gib(p.activation_bytes)}) exceed "
                         f"the reserve; lower max_num_batched_tokens or hbm_utilization")
        if p.kv_budget_bytes == 0:
            lines.append("  WARNING: the weights do not fit in device memory")
    else:
        lines.append("  device memory              unknown (give --hbm to size the KV cache)")
    ar = p.allreduce_bytes_per_token_per_layer
    if ar:
        per_layer = p.allreduce_seconds(ar)
        step = p.allreduce_seconds(ar * p.num_layers + ar // 2)
        lines += [
            f"  all-reduce per token/layer {ar / 2**10:.1f} KiB (2 x hidden {p.hidden_size} x "
            f"{p.dtype}: after o_proj and down_proj) = {per_layer * 1e9:.1f} ns at "
            f"{p.link_gbps:g} GB/s per direction (ring: 2(M-1)/M of the bytes per link)",
            f"  all-reduce per token/step  {2 * p.num_layers + 1} all-reduces, "
            f"{step * 1e6:.2f} us of link time; a decode step of {p.max_num_seqs} tokens: "
            f"{step * p.max_num_seqs * 1e6:.1f} us (bandwidth only; each all-reduce also has "
            f"a fixed latency of a few us)",
        ]
    else:
        lines.append("  all-reduce                 none (M = 1)")
    return "\n".join(lines)


def plan_for_engine(core) -> str:
    """The plan of a running engine (EngineCore or DataParallelEngine), for the server's
    start-up log; device memory from the first device's stats (unknown on CPU)."""
    import jax
    import jax.numpy as jnp

    cfg = core.config
    stats = jax.devices()[0].memory_stats() or {}
    plan = make_plan(core.model_config, model=cfg.model, mesh=cfg.mesh or "1x1",
                     dtype=jnp.dtype(core.dtype).name, kv_cache_dtype=cfg.kv_cache_dtype,
                     max_model_len=core.max_model_len, max_num_seqs=cfg.max_num_seqs,
                     max_num_batched_tokens=cfg.num_batched_tokens,
                     hbm_bytes=stats.get("bytes_limit"), hbm_utilization=cfg.hbm_utilization)
    return format_plan(plan)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True,
                    help="checkpoint dir, config.json, or a built-in: "
                         + ", ".join(BUILTIN_CONFIGS))
    ap.add_argument("--mesh", default="1x1", help="'DxM' (data x model parallel)")
    ap.add_argument("--hbm", default=None, help="memory per device, e.g. 80GiB")
    ap.add_argument("--hbm-utilization", type=float, default=0.9,
                    help="share of the memory left after the weights that the KV cache gets; "
                         "the rest is the activation reserve")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--interconnect-gbps", type=float, default=DEFAULT_LINK_GBPS,
                    help="link bandwidth per direction per device in GB/s (default: NVLink 4 "
                         "on H100 SXM, 450)")
    args = ap.parse_args(argv)
    try:
        mc = load_model_config(args.model)
        plan = make_plan(mc, model=args.model, mesh=args.mesh, dtype=args.dtype,
                         kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         hbm_bytes=parse_bytes(args.hbm) if args.hbm else None,
                         hbm_utilization=args.hbm_utilization, link_gbps=args.interconnect_gbps)
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")
    print(format_plan(plan))


if __name__ == "__main__":
    main()
