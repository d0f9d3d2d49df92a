"""The printout of a jaxserve.planning.plan.Plan (`python -m jaxserve.plan`, the server's start-up log)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.core.host_pages import size_host_tier, size_sliding_host_tier, sliding_per_page
from jaxserve.build.kv_budget import WORKSPACE_SHARE

if TYPE_CHECKING:
    from jaxserve.planning.plan import Plan


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def format_plan(p: Plan) -> str:
    d, m = p.mesh
    lines = [
        f"plan: {p.model} on mesh {d}x{m} ({d} replica{'s' if d > 1 else ''} x {m}-way tensor "
        f"parallel{', experts expert-parallel' if p.expert_parallel else ''}), weights {p.dtype}"
        + (f" (linear layers {p.quantization}-quantized)" if p.quantization else "")
        + f", KV cache {p.kv_dtype}",
        f"  parameters                 {p.num_params:,} ({p.num_params / 1e9:.2f} B)"
        if p.num_params >= 1e9 else f"  parameters                 {p.num_params:,}",
        f"  weights per replica        {_gib(p.weight_bytes)}",
        f"  weights per device         {_gib(p.weight_bytes_per_device)} "
        f"(of which replicated on every device: {_gib(p.replicated_param_bytes)})",
    ]
    if (v := p.vision) is not None:
        lines.append(f"  vision tower               {v.num_params:,} params, "
                     f"{_gib(v.weight_bytes)} on every device; encoder cache {v.cache_rows:,} "
                     f"rows, {_gib(v.cache_bytes)}; largest encoder call ({v.buckets[-1]:,}) "
                     f"~{_gib(v.activation_bytes)} of activations (both out of the cache budget)")
    if p.has_state:
        lines.append(f"  layers                     {p.num_layers}: {p.full_attention_layers} full "
                     f"attention (KV cache), {p.num_layers - p.full_attention_layers} linear "
                     f"attention (recurrent state)")
    elif p.sliding_attention_layers:
        lines.append(f"  layers                     {p.num_layers}: {p.full_attention_layers} global "
                     f"attention (KV of every token), {p.sliding_attention_layers} "
                     f"sliding-window attention (KV of the last {p.sliding_window:,} tokens)"
                     + (f", {p.kv_shared_layers} reading an earlier layer's KV (none of "
                        f"their own)" if p.kv_shared_layers else ""))
    if p.kv_heads_stored != p.kv_heads:
        lines.append(f"  KV heads                   {p.kv_heads} do not divide by {m}: each "
                     f"replicated {p.kv_heads_stored // p.kv_heads}x, "
                     f"{p.kv_heads_stored // m} per device")
    else:
        lines.append(f"  KV heads                   {p.kv_heads}, {p.kv_heads // m} per device")
    if p.global_kv_heads:
        repeat = p.global_kv_heads_stored // p.global_kv_heads
        lines.append(f"  global layers' KV heads    {p.global_kv_heads}"
                     + (f", each replicated {repeat}x" if repeat > 1 else "")
                     + f", {p.global_kv_heads_stored // m} per device")
    kind = "full-attention layers" if p.has_state else \
        "global layers" if p.sliding_attention_layers else "layers"
    lines.append(f"  KV cache per token/device  {p.kv_bytes_per_token_per_device / 2**10:.1f} KiB "
                 f"({p.full_attention_layers} {kind} x K and V)"
                 + (f" + {p.sliding_kv_bytes_per_token_per_device / 2**10:.1f} KiB "
                    f"({p.sliding_attention_layers} sliding-window layers, for the tokens in "
                    f"a window only)" if p.sliding_attention_layers else ""))
    if p.has_state:
        split = p.state_bytes_per_seq // p.state_bytes_per_seq_per_device
        lines.append(f"  state per sequence         {_gib(p.state_bytes_per_seq)} ({p.state_layout}), "
                     f"{_gib(p.state_bytes_per_seq_per_device)} per device"
                     + (f" (split by head {split} ways)" if split > 1 else ""))
    if p.hbm_bytes:
        lines += _memory_lines(p)
    lines += _cache_lines(p) if p.cache else [
        "  device memory              unknown (give --hbm to size the KV cache)"]
    if p.speculative:
        lines.append(f"  {p.speculative}")
    if p.lora:
        lines.append(f"  {p.lora}")
    return "\n".join(lines + _allreduce_lines(p))


def _memory_lines(p: Plan) -> list[str]:
    m = p.memory
    drafter = (f" (+ drafter {_gib(p.drafter_weight_bytes_per_device)})"
               if p.drafter_weight_bytes_per_device else "") + (
        f" (+ LoRA slots {_gib(p.lora_bytes_per_device)})" if p.lora_bytes_per_device else "") + (
        f" (+ vision tower {_gib(p.vision.weight_bytes)})" if p.vision else "")
    cache = ("KV cache and state " if p.has_state else "KV ") + _gib(p.kv_budget_bytes) \
        + (" (--kv-cache-memory-bytes)" if p.kv_cache_memory_bytes is not None else "")
    return [
        f"  device memory              {_gib(m.device_bytes)}, of which the engine takes "
        f"{p.hbm_utilization:.0%} (--gpu-memory-utilization) = {_gib(m.engine_bytes)}: "
        f"weights {_gib(p.weight_bytes_per_device)}{drafter} + reserve "
        f"{_gib(m.reserve_bytes)} (the larger of {WORKSPACE_SHARE:.0%} and the estimated "
        f"activations ~{_gib(p.activation_bytes)}: {p.max_num_batched_tokens} tokens/step, "
        f"sampler over {p.max_num_seqs} rows"
        + (f", or the largest encoder call's ~{_gib(p.vision.activation_bytes)}) + encoder "
           f"cache {_gib(m.later_bytes)}" if p.vision else ")")
        + f" + {cache}; {_gib(m.outside_bytes)} left to others"]


def _cache_lines(p: Plan) -> list[str]:
    """The cache plan: what the engine allocates (build/cache_plan.py)."""
    d = p.mesh[0]
    c = p.cache
    seqs = p.kv_tokens // p.max_model_len
    lines = []
    if p.has_state:
        snaps = c.num_snapshot_slots
        held = (f" + {snaps} prefix-cache snapshots (their share of the caches: "
                f"{_gib(c.snapshot_bytes)})" if snaps else "")
        running = "2 x max_num_seqs + 1: a backup each for speculative decoding" \
            if c.state_slots_per_seq == 2 else "max_num_seqs + 1"
        lines.append(f"  state slots                {p.state_slots} ({running}){held} x "
                     f"{_gib(p.state_bytes_per_seq_per_device)} = {_gib(p.state_budget_bytes)}, "
                     f"allocated first; the KV pages get the remaining "
                     f"{_gib(p.page_budget_bytes)}")
    if c.has_sliding:
        lines += [
            f"  sliding-window KV pages    {c.num_sliding_pages - 1:,} x {c.page_size} tokens "
            f"(+ the null page) x {c.num_sliding_layers} layers, {_gib(c.sliding_kv_bytes)} "
            f"per device, allocated first ({p.max_num_seqs} windows + one step's tokens)",
            f"  sliding-window saving      at most {c.sliding_pages_per_seq} pages kept per "
            f"sequence (its window), not one per {c.page_size} tokens: keeping every token's KV "
            f"in those layers, this KV memory would hold {c.full_history_kv_tokens:,} tokens, "
            f"not {p.kv_tokens:,}"]
    layers = "global layers" if c.has_sliding else "layers"
    lines += [
        f"  KV pages per replica       {max(c.num_pages - 1, 0):,} x {c.page_size} tokens (+ the "
        f"null page) x {c.num_kv_layers} {layers}, {_gib(c.global_kv_bytes)} per device",
        f"  KV capacity per replica    {p.kv_tokens:,} tokens = {seqs} sequences x "
        f"{p.max_model_len:,} tokens (max_model_len)"
        + (f"; x{d} replicas = {d * p.kv_tokens:,} tokens" if d > 1 else ""),
        f"  max_num_seqs={p.max_num_seqs} x max_model_len={p.max_model_len:,}   "
        + ("fits" if p.memory_fits else f"does NOT fit: at most {p.max_sequences} full-length "
           f"sequences, or {p.kv_tokens // p.max_num_seqs:,} tokens each for {p.max_num_seqs}"),
    ]
    if p.host_tier_bytes:
        lines.append(_host_tier_line(p))
    if p.compiler_limit:
        lines.append(f"  does NOT compile for TPU: {p.compiler_limit}")
    if p.hbm_bytes and p.kv_budget_bytes == 0:
        lines.append("  WARNING: the weights do not fit in device memory")
    elif p.state_budget_bytes > p.kv_budget_bytes:
        lines.append(f"  WARNING: the recurrent state of {p.state_slots} sequences "
                     f"({_gib(p.state_budget_bytes)}) does not fit in the "
                     f"{_gib(p.kv_budget_bytes)} left for the cache; lower max_num_seqs")
    elif not p.memory_fits:
        lines.append(f"  WARNING: the plan does not fit: {p.max_num_seqs} sequences of "
                     f"{p.max_model_len:,} tokens need {p.max_num_seqs * p.max_model_len:,} "
                     f"tokens of KV cache, the cache holds {p.kv_tokens:,}; lower "
                     f"max_num_seqs or max_model_len")
    return lines


def _host_tier_line(p: Plan) -> str:
    """The prefix cache's host tier: what --kv-offloading-size holds (whole pages of every
    KV head: the host keeps a replica's pages, not one device's share; a model drafter's
    KV layers in each page, as the cache plan counts them)."""
    c, m = p.cache, p.mesh[1]
    state_bytes = p.state_bytes_per_seq if p.has_state else 0
    if c.has_sliding:   # Gemma 4: the sliding group's pages in slots of their own
        pages, states, sliding = size_sliding_host_tier(
            p.host_tier_bytes, c.bytes_per_page * m, c.bytes_per_sliding_page * m,
            sliding_per_page(c.bytes_per_page, c.bytes_per_sliding_page), state_bytes)
    else:
        (pages, states), sliding = size_host_tier(p.host_tier_bytes, c.bytes_per_page * m,
                                                  state_bytes), 0
    snaps = f", {max(states - 1, 0):,} state snapshots" if state_bytes else ""
    if c.has_sliding:
        snaps += f", {max(sliding - 1, 0):,} sliding-window pages"
    return (f"  host tier                  {_gib(p.host_tier_bytes)} of host memory per replica: "
            f"{max(pages - 1, 0):,} pages ({max(pages - 1, 0) * c.page_size:,} tokens){snaps}, "
            f"restored into free device pages on a prefix hit")


def _allreduce_lines(p: Plan) -> list[str]:
    ar = p.allreduce_bytes_per_token_per_layer
    if not ar:
        return ["  all-reduce                 none (M = 1)"]
    per_layer = p.allreduce_seconds(ar)
    step = p.allreduce_seconds(ar * p.num_layers + ar // 2)
    mixer = "o_proj or out_proj" if p.has_state else "o_proj"
    return [
        f"  all-reduce per token/layer {ar / 2**10:.1f} KiB (2 x hidden {p.hidden_size} x "
        f"{p.dtype}: after {mixer} and down_proj) = {per_layer * 1e9:.1f} ns at "
        f"{p.link_gbps:g} GB/s per direction (ring: 2(M-1)/M of the bytes per link)",
        f"  all-reduce per token/step  {2 * p.num_layers + 1} all-reduces, "
        f"{step * 1e6:.2f} us of link time; a decode step of {p.max_num_seqs} tokens: "
        f"{step * p.max_num_seqs * 1e6:.1f} us (bandwidth only; each all-reduce also has "
        f"a fixed latency of a few us)",
    ]
