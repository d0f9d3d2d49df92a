"""benchmarks/gpu_session.sh in its tiny CPU mode: every step of the GPU session on tiny
models, so the script a GPU session runs cannot rot between sessions."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TPOT_STEPS = ["tpot_base", "tpot_async", "tpot_nomerge", "tpot_cmdbuf", "qwen_w8a8", "qwen_tpot"]
STEPS = [*TPOT_STEPS[:4], "host_tier", *TPOT_STEPS[4:], "llama_bf16", "qwen_fp8", "llama_fp8",
         "check_llama-tiny", "transformers", "serve_8b", "tpot_triton", "roofline", "scan_probe"]


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> tuple[dict, str, subprocess.CompletedProcess]:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    tmp = tmp_path_factory.mktemp("gpu_session")
    out = tmp / "out"
    env = {**os.environ, "OUT": str(out), "WORK": str(tmp / "work"),
           # the suite's persistent compilation cache: warm runs load the tiny programs
           "CACHE": os.environ.get("JAXSERVE_COMPILATION_CACHE",
                                   os.path.expanduser("~/.cache/jaxserve/xla")),
           "PYTHON": sys.executable,
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(["bash", "benchmarks/gpu_session.sh", "--tiny"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), str(out), run


def test_every_step_runs_in_tiny_mode(session):
    doc, out, _ = session
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == STEPS
    for name, s in steps.items():
        assert s["status"] == "ok", (name, s)
        assert s["command"] and 0 <= s["seconds"] <= s["limit_s"], s
        assert s["figures"], name
    # at most 8 files come back from a device session: three are written
    assert sorted(os.listdir(out)) == ["details.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(os.path.join(out, "details.tar.gz")) as tar:
        names = set(tar.getnames())
    assert {f"{n}.json" for n in STEPS if not n.startswith("check_")} <= names
    assert {f"{n}.log" for n in STEPS} <= names


def test_each_figure_says_device_jax_commit_and_command(session):
    doc, out, _ = session
    s = doc["session"]
    assert s["device"] and s["jax"] and len(s["git"]["commit"]) == 40
    md = open(os.path.join(out, "summary.md"), encoding="utf-8").read()
    assert f"jax {s['jax']}" in md and s["git"]["commit"][:10] in md
    for step in doc["steps"]:
        assert f"    {step['command']}" in md


def test_engine_steps_measure_what_the_issue_asks(session):
    doc, _, _ = session
    steps = {s["name"]: s["figures"] for s in doc["steps"]}
    for name, rows in (("llama_bf16", [1, 2, 4]), ("llama_fp8", [1, 2, 4]), ("qwen_fp8", [1, 2])):
        f = steps[name]
        assert [t["rows"] for t in f["throughput"]] == rows
        assert all(t["output_tokens_per_second"] > 0 for t in f["throughput"])
        assert f["warmup_programs"] > 0 and f["startup_s"] > 0
        assert f["ttft_ms"] > 0 and f["tpot_ms"] is not None
        # nothing compiles once warmup is done
        assert f["compilations_after_warmup"] == 0, name
        assert all(t["compilations_during_run"] == 0 for t in f["throughput"])
        # the start-up log names the attention path of every layer group
        assert any(k.startswith("attention: xla page loop for ") for k in f["kernels"]), f
        assert any(k.startswith("matmul: xla dot for ") for k in f["kernels"])
    assert any("float8_e4m3fn cache" in k for k in steps["llama_fp8"]["kernels"])
    # the traced decode steps: each step's wall time and the host's launches in it
    for name, rows in (("llama_bf16", [1, 2]), ("qwen_fp8", [1]), ("tpot_base", [1]),
                       ("qwen_w8a8", [1])):
        prof = steps[name]["profile"]
        assert [p["rows"] for p in prof] == rows, prof
        assert all(p["wall_ms"] > 0 and any("forward" in k for k in p["host_launch_ms"])
                   and p["rows_decoding"] == p["rows"] for p in prof), prof
    assert any(k.startswith("linear attention: ") for k in steps["qwen_fp8"]["kernels"])
    assert [b["batch"] for b in steps["transformers"]["batches"]] == [1, 2]
    # the A/B variants: batch-1 latency alone, nothing compiled after warmup
    assert any("(w8a8)" in k for k in steps["qwen_w8a8"]["kernels"]), steps["qwen_w8a8"]
    assert not any("(w8a8)" in k for k in steps["qwen_tpot"]["kernels"])
    for name in (*TPOT_STEPS, "tpot_triton"):
        f = steps[name]
        assert f["throughput"] == [] and f["ttft_ms"] > 0 and f["tpot_ms"] is not None
        assert f["compilations_after_warmup"] == 0
    serve = steps["serve_8b"]
    assert serve["completed"] == 4 and serve["failed"] == 0 and serve["output_throughput"] > 0
    # the server's engine is llama_bf16's: its programs come from the compilation cache
    assert serve["warmup"]["fresh"] == 0 and serve["warmup"]["from_cache"] > 0
    host = steps["host_tier"]   # the host KV tier's copies and the link, each way
    assert set(host["gb_per_s"]) == {"offload", "restore", "link_to_device", "link_to_host"}
    assert all(v > 0 for v in host["gb_per_s"].values()) and host["restore_share_of_link"] > 0
    roof = steps["roofline"]
    assert set(roof["matmul_tflops_by_dtype"]) == {"float32", "float8_e4m3fn"}
    check = steps["check_llama-tiny"]["rows"][0]
    assert check["passed"] and check["xla"]["prompt_logprob_mean_abs_diff"] < 0.03
