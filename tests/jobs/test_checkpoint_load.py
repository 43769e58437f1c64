"""scripts/bench/checkpoint_load.py on CPU with a tiny shape: it writes a checkpoint, times megacp's loader,
transformers' and the two finiteness checks, and records every row and ratio."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S


def test_checkpoint_load_benchmark_on_cpu(tmp_path):
    out = tmp_path / "load.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.checkpoint_load", "--tiny", "--repeats", "1", "--dir",
                    str(tmp_path / "ckpt"), "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=HANG_GUARD_S)
    report = json.loads(out.read_text())
    assert (tmp_path / "ckpt" / "model.safetensors").is_file() and report["checkpoint_bytes"] > 0
    rows = {r["method"]: r["s"] for r in report["results"]}
    assert set(rows) == {"megacp load_model", "transformers from_pretrained", "all_finite (sum first)",
                         "isfinite(t).all()"} and all(s >= 0 for s in rows.values()), rows
    assert set(report["ratios"]) == {"megacp_over_transformers", "isfinite_over_all_finite"}
