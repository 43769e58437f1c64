"""scripts/bench/train_long.py on CPU with a tiny shape: the megacp method climbs its ladder in
child processes and reports each step (the ALST peer needs minutes on CPU; the GPU run covers it)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.paths import ROOT


def test_megacp_ladder_on_cpu(tmp_path):
    out = tmp_path / "long.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.train_long", "--tiny", "--device", "cpu", "--layers", "2",
                    "--methods", "megacp", "--seq-lens", "32,64", "--steps", "2", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=240)
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["method"], r["seq"]) for r in rows] == [("megacp", 32), ("megacp", 64)]
    assert all("error" not in r and r["tokens_per_s"] > 0 and 0 < r["loss"] < 10 for r in rows)
    assert "2 layer inputs offloaded" in rows[0]["plan"] and report["longest"] == {"megacp": 64}
