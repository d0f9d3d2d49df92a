"""benchmarks/step/cpu_attention.py with a small cache: both cases run for this tree and
for a git revision loaded beside it, each within bf16 rounding of the reference kernel."""
from __future__ import annotations

import re

from benchmarks.step import cpu_attention


def test_both_cases_against_a_revision(capsys):
    assert cpu_attention.main(["--num-pages", "3100", "--against", "HEAD", "--repeats", "1",
                               "--calls", "1"]) == 0
    out = capsys.readouterr().out
    devs = re.findall(r"^(\w+) (HEAD|this tree): max deviation from the reference (\S+)$",
                      out, re.M)
    assert [(c, n) for c, n, _ in devs] == [(c, n) for c in ("decode", "prefill")
                                            for n in ("HEAD", "this tree")]
    assert all(float(d) < 1e-2 for *_, d in devs)
    rounds = re.findall(r"^(\w+) (HEAD|this tree) round 1: ([\d.]+) ms", out, re.M)
    assert len(rounds) == 4 and all(float(ms) > 0 for *_, ms in rounds)
