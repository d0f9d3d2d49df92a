"""benchmarks/gpu/trace_summary.py on a hand-written Chrome trace: the decode window, the
device's busy time over overlapping streams, and the host's launch time per step."""
from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.gpu import trace_summary

HOST, GPU = 1, 2


def _trace(tmp_path, thread: str = "python") -> str:
    meta = [{"ph": "M", "pid": HOST, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": HOST, "tid": 7, "name": "thread_name", "args": {"name": thread}},
            {"ph": "M", "pid": GPU, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    ev = []
    # a prefill launch at 0 (its kernel 0-500), then decode launches every 100 us from 1000
    ev.append({"ph": "X", "pid": HOST, "tid": 7, "name": "PjitFunction(_forward_fn)",
               "ts": 0, "dur": 30})
    ev.append({"ph": "X", "pid": GPU, "tid": 1, "name": "prefill_gemm", "ts": 0, "dur": 500})
    for k in range(5):
        t = 1000 + 100 * k
        ev.append({"ph": "X", "pid": HOST, "tid": 7, "name": "PjitFunction(_forward_fn)",
                   "ts": t, "dur": 10})
        # jax records each call twice: the C++ span nested in the wrapper's
        ev.append({"ph": "X", "pid": HOST, "tid": 7, "name": "PjitFunction(_forward_fn)",
                   "ts": t + 1, "dur": 8})
        ev.append({"ph": "X", "pid": HOST, "tid": 7, "name": "PjitFunction(_sample_fn)",
                   "ts": t + 10, "dur": 5})
        ev.append({"ph": "X", "pid": HOST, "tid": 7, "name": "CommonPjRtBuffer::Await",
                   "ts": t + 20, "dur": 50})
        # two streams overlapping by 10 us: busy 30 + 30 - 10 = 50 us a step
        ev.append({"ph": "X", "pid": GPU, "tid": 1, "name": "gemm", "ts": t + 15, "dur": 30})
        ev.append({"ph": "X", "pid": GPU, "tid": 2, "name": "attention", "ts": t + 35,
                   "dur": 30})
    path = tmp_path / "plugins" / "vm.trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + ev}, f)
    return str(path)


@pytest.mark.parametrize("thread", ["python", "python3"])   # jax 0.10 / the GPU image's 0.11
def test_decode_window_split(tmp_path, thread):
    path = _trace(tmp_path, thread)
    assert trace_summary.trace_file(str(tmp_path)) == path
    s = trace_summary.summarise(path, steps=3)
    # three whole periods between the last four launches: the prefill is left out
    assert s["steps"] == 3 and s["step_launches"] == 6
    assert s["wall_ms_per_step"] == pytest.approx(0.1)
    assert s["host_launch_ms_per_step"] == pytest.approx({"_forward_fn": 0.01,
                                                          "_sample_fn": 0.005})
    assert s["host_await_ms_per_step"] == pytest.approx(0.05)
    (dev,) = s["devices"]
    assert dev["busy_ms_per_step"] == pytest.approx(0.05)
    assert dev["kernels_per_step"] == 2
    assert [k["name"] for k in dev["top"]] == ["gemm", "attention"]
    assert "prefill_gemm" not in trace_summary.markdown(s)


def test_more_steps_than_traced_take_them_all(tmp_path):
    s = trace_summary.summarise(_trace(tmp_path), steps=50)
    assert s["steps"] == 5   # six launches: five periods, the prefill's among them
    assert s["devices"][0]["top"][0]["name"] == "prefill_gemm"
