"""benchmarks/multimodal/encoder_attention.py at a small size: every case runs for this
tree and a git revision beside it, and the two agree."""
from __future__ import annotations

import re

from benchmarks.multimodal import encoder_attention


def test_cases_against_a_revision(capsys):
    assert encoder_attention.main(["--patches", "64", "--block", "16", "--against", "HEAD",
                                   "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    devs = re.findall(r"^(.+): max deviation between the revisions (\S+)$", out, re.M)
    assert [c for c, _ in devs] == list(encoder_attention.cases(64))
    assert all(float(d) < 1e-5 for _, d in devs)
    times = re.findall(r"^(.+): HEAD ([\d.]+) ms, this tree ([\d.]+) ms$", out, re.M)
    assert len(times) == 3 and all(float(a) > 0 and float(b) > 0 for _, a, b in times)
