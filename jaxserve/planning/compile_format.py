"""The text report of `python -m jaxserve.plan --compile` (planning/plan_compile.py's
CompileReport, with its decode steps' accounting)."""
from __future__ import annotations

from typing import Any

from jaxserve.planning.plan_compile import CompileReport
from jaxserve.planning.plan_format import _gib


def format_report(r: CompileReport) -> str:
    head = (f"compile: {r.model} on {r.target} mesh {r.mesh}, max_model_len "
            f"{r.max_model_len:,} (compiler estimate on a CPU host, not a TPU measurement)")
    if r.error:
        return f"{head}\n  the engine would not start: {r.error}\n  fits: no"
    lines = [head,
             f"  HBM per chip {_gib(r.hbm_bytes)} usable (of {_gib(r.published_hbm_bytes)}): "
             f"weights {_gib(r.weight_bytes_per_device)} + "
             + (f"LoRA slots {_gib(r.lora_bytes_per_device)} + " if r.lora_bytes_per_device
                else "")
             + f"KV {r.num_pages - 1:,} pages {_gib(r.kv_bytes_per_device)}"
             + (f" + state {_gib(r.state_bytes_per_device)}" if r.state_bytes_per_device else "")
             + (f" + vision tower {_gib(r.vision_weight_bytes_per_device)} + encoder cache "
                f"{_gib(r.encoder_cache_bytes_per_device)} (the largest encoder call's "
                f"reserve ~{_gib(r.encoder_activation_bytes)})"
                if r.vision_weight_bytes_per_device else "")
             + f" per device (planner: {_gib(r.planner_bytes_per_device)})",
             f"  warmup compiles {r.warmup_programs} programs; compiled here {len(r.programs)}, "
             f"{r.compile_workers} at a time, in {r.wall_seconds:.1f} s:",
             f"  {'program':34} {'bucket':>8} {'seconds':>8} {'argument':>11} {'temp':>11} "
             f"{'peak':>11} {'device peak':>11}"]
    for p in r.programs:
        bucket = f"t={p.tokens}" if p.tokens is not None else \
            f"r={p.rows}" if p.rows is not None else ""
        if p.compiled:
            lines.append(f"  {p.name:34} {bucket:>8} {p.compile_seconds:8.1f} "
                         f"{_gib(p.argument_bytes):>11} {_gib(p.temp_bytes):>11} "
                         f"{_gib(p.peak_bytes):>11} {_gib(p.device_peak_bytes):>11}")
        else:
            first = p.error.splitlines()[0][:200]
            lines.append(f"  {p.name:34} {bucket:>8} {p.compile_seconds:8.1f}  FAILED: {first}")
    failed = sum(not p.compiled for p in r.programs)
    why = f": {failed} of {len(r.programs)} programs did not compile" if failed else ""
    if r.encoders_over_reserve:
        why += (f"{'; ' if why else ': '}encoder temporaries over the reserve "
                f"~{_gib(r.encoder_activation_bytes)}: " + ", ".join(
                    f"t={p.tokens} {_gib(p.temp_bytes)}" for p in r.encoders_over_reserve))
    lines += ["  (peak: the program's own, argument + output + temp - alias; device peak: "
              "with everything resident beside it, the weights and caches it does not take)",
              f"  fits: {'yes' if r.fits else 'no'}{why} (the engine starts when every program "
              f"compiles with a device peak within the {_gib(r.hbm_bytes)} of HBM"
              + (", each encoder call's temporaries within its reserve"
                 if r.encoder_activation_bytes else "") + ")"]
    return "\n".join(lines + [ln for d in r.decode for ln in format_decode(d)])


def format_decode(d: dict[str, Any]) -> list[str]:
    head = f"  decode step, {d['rows']} rows at context {d['context']:,}"
    if d.get("error"):
        return [f"{head}: {d['error']}"]
    roof = d["roofline"]
    lines = [f"{head} ({' + '.join(d['programs'])}): {_gib(d['step_bytes'])} moved, "
             f"{d['ratio']:.2f}x the roofline {_gib(d['roofline_bytes'])} (weights "
             f"{_gib(roof['weight_bytes'])} + KV read {_gib(roof['kv_read_bytes'])} + "
             f"written {_gib(roof['kv_write_bytes'])} + state {_gib(roof['state_bytes'])})"]
    lines += [f"    {o['share']:6.1%} {_gib(o['total']):>11} {o['opcode']:12} x{o['runs']:<4} "
              f"{o['op_name'][-60:]}{' (' + o['how'] + ')' if o['how'] else ''}"
              for o in d["top_ops"]]
    if d["dynamic_loops"]:
        lines.append(f"    not run by decode rows: {len(d['dynamic_loops'])} loops of input-set "
                     f"trip counts, {_gib(sum(x['bytes_per_trip'] for x in d['dynamic_loops']))}"
                     f" per trip of each")
    return lines
