"""benchmarks/lora/lora_op.py at tiny widths: every case runs and prints its ratio to the
base dot (the figures themselves are the benchmark's, not the test's)."""
from __future__ import annotations

import re
import sys

from benchmarks.lora import lora_op


def test_every_case_runs_at_tiny_widths(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lora_op", "--tokens", "8,40", "--in-dim", "32",
                                      "--out-dim", "48", "--rank", "2", "--slots", "5",
                                      "--iters", "1"])
    lora_op.main()
    rows = re.findall(r"T=\s*(\d+)\s+(.+?)\s+[\d.]+ ms\s+x([\d.]+)", capsys.readouterr().out)
    cases = ["base dot"] + [f"{n} adapter(s), {form}" for n in (1, 4)
                            for form in ("chosen", "all-slots pass", "windowed loop")]
    assert [(int(t), c) for t, c, _ in rows] == [(t, c) for t in (8, 40) for c in cases]
    assert all(float(r) > 0 for *_, r in rows)
