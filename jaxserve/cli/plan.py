"""`python -m jaxserve.plan` / `jaxserve plan`: the planner's command line.

It takes every engine flag the server takes (EngineConfig's, made by
jaxserve/config/engine_args.py, speculation included, and vLLM's engine flags without a
jaxserve knob), builds the same EngineConfig, and plans it with the engine's own layout
and cache planning (planning/plan.py); its own flags say what device to plan for.
"""
from __future__ import annotations

import argparse
import json
import sys

from jaxserve.checkpoints.model_configs import ALIASES
from jaxserve.checkpoints.model_names import load_model_config
from jaxserve.config import EngineConfig, default_max_num_seqs
from jaxserve.config.engine_args import (FLAGS, dashed, add_engine_args, add_vllm_compat_args,
                                         check_vllm_compat, config_error, engine_kwargs)
from jaxserve.config.vllm_compat import ENGINE
from jaxserve.errors import ConfigError
from jaxserve.planning.plan import DEFAULT_LINK_GBPS, format_plan, parse_bytes, plan_from_config
from jaxserve.planning.compile_format import format_report
from jaxserve.planning.plan_compile import compile_plan
from sharding.tpu_targets import tpu_target


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.plan", usage="%(prog)s --model MODEL "
                                 "[options]", description="What a model needs on a 'DxM' "
                                 "mesh: the engine's plan for these flags, computed from "
                                 "the model's config.")
    ap.add_argument("--model", required=True,
                    help="an alias (" + ", ".join(ALIASES) + ") or its repo id, a checkpoint "
                         "dir, a config.json, or a repo id in the local Hugging Face cache")
    ap.add_argument("--hbm", default=None, help="memory per device, e.g. 80GiB (what "
                    "--gpu-memory-utilization is a share of)")
    ap.add_argument("--interconnect-gbps", type=float, default=DEFAULT_LINK_GBPS,
                    help="link bandwidth per direction per device in GB/s (default: NVLink 4 "
                         "on H100 SXM, 450)")
    ap.add_argument("--target", default=None, help="a TPU (tpu-v5e, tpu-v6e, tpu-v5p): its "
                    "usable HBM per chip; with --compile, the chip to compile for")
    ap.add_argument("--compile", nargs="?", const="default", choices=("default", "all", "decode"),
                    default=None, help="compile the engine's warmup programs for --target on "
                    "this host: the smallest and largest forward token bucket and the costliest "
                    "sampler (penalties, largest row bucket), or 'all' of them, or only the "
                    "decode steps of --decode-rows")
    ap.add_argument("--decode-rows", default=None, help="with --compile: account the decode "
                    "step's HBM bytes op by op at these rows, beside the roofline (comma-"
                    "separated; default 1; '' for none)")
    ap.add_argument("--decode-context", type=int, default=None, help="tokens each decode row "
                    "reads (default: max_model_len, or the rows' share of the KV pages)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(ap)   # every engine flag of `jaxserve serve`
    add_vllm_compat_args(ap, ENGINE, "vLLM engine flags without a jaxserve knob")
    return ap


def parse_args(ap: argparse.ArgumentParser,
               argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    """The flags and the EngineConfig they make (exit 2 naming a bad flag, as the
    server)."""
    args = ap.parse_args(dashed(sys.argv[1:] if argv is None else list(argv)))
    check_vllm_compat(ap, args, ENGINE)
    try:
        config = EngineConfig(model=args.model, **engine_kwargs(args))
    except ConfigError as e:
        config_error(ap, e)
    return args, config


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args, config = parse_args(ap, argv)
    try:
        if args.target and args.hbm:
            raise ValueError("give --hbm or --target (which sets the HBM), not both")
        if args.compile:
            if not args.target:
                raise ValueError("--compile needs --target (tpu-v5e, tpu-v6e or tpu-v5p)")
            return _compile(args, config, decode_rows(args, config))
        if args.decode_rows is not None or args.decode_context is not None:
            raise ValueError("--decode-rows and --decode-context need --compile")
        hbm = _target_hbm(args.target) if args.target else \
            parse_bytes(args.hbm) if args.hbm else None
        plan = plan_from_config(config, load_model_config(args.model), hbm_bytes=hbm,
                                platform="tpu" if args.target else "gpu",
                                link_gbps=args.interconnect_gbps, label=args.model)
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")
    print(json.dumps(plan.to_json()) if args.json else format_plan(plan))


def decode_rows(args: argparse.Namespace, config: EngineConfig) -> tuple[int, ...]:
    """--decode-rows as row counts the engine can decode, --decode-context checked too."""
    text = "1" if args.decode_rows is None else args.decode_rows
    try:
        rows = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--decode-rows {text[:40]!r}: expected comma-separated row "
                         f"counts, e.g. 1,64,256") from None
    most = config.max_num_seqs or default_max_num_seqs("tpu")
    for r in rows:
        if not 1 <= r <= most:
            raise ValueError(f"--decode-rows {r}: each must be 1 to --max-num-seqs ({most})")
    ctx = args.decode_context
    if ctx is not None and config.max_model_len is not None \
            and not 1 <= ctx <= config.max_model_len:
        raise ValueError(f"--decode-context {ctx}: must be 1 to --max-model-len "
                         f"({config.max_model_len})")
    return rows


def _target_hbm(target: str) -> int:
    """What the engine would see as the chip's memory (the runtime keeps the rest)."""
    return tpu_target(target).usable_hbm_bytes


# Fields compile_plan sets itself: the replica's mesh, abstract weights, no cache dir.
_COMPILE_OWN = ("mesh", "tensor_parallel_size", "data_parallel_size", "load_format",
                "compilation_cache_dir")


def _compile(args: argparse.Namespace, config: EngineConfig, rows: tuple[int, ...]) -> None:
    """--compile: build the engine for --target, compile, print the report."""
    def progress(r) -> None:   # flagship programs take minutes each: say what is done
        state = "compiled" if r.compiled else "FAILED"
        print(f"[plan] {r.name} {r.tokens or r.rows}: {state} in {r.compile_seconds:.1f} s",
              file=sys.stderr, flush=True)

    kw = {name: getattr(config, name) for name in FLAGS if name not in _COMPILE_OWN}
    report = compile_plan(args.model, target=args.target, mesh=config.mesh or "1x1",
                          select=args.compile, progress=progress, decode_rows=rows,
                          decode_context=args.decode_context, **kw)
    print(json.dumps(report.to_json()) if args.json else format_report(report))
