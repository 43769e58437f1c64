"""scripts/bench/offline_throughput.py on CPU with a tiny shape: the same greedy requests through
``LLM.generate``, through ``megacp.serve`` (all at once) and through transformers' batched
``generate``; the offline call and the server answer every request with the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S


def test_offline_batch_against_the_server_and_transformers_on_cpu(tmp_path) -> None:
    out = tmp_path / "offline.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.offline_throughput", "--tiny", "--requests", "6",
                    "--min-prompt", "16", "--max-prompt", "96",
                    "--min-tokens", "8", "--max-tokens", "24", "--hf-batch", "4", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=HANG_GUARD_S)
    report = json.loads(out.read_text())
    assert report["requests"] == 6 and 6 * 8 <= report["new_tokens"] <= 6 * 24
    assert report["same_tokens_llm_server"] == 6
    rates = {r["method"]: r["tokens_per_s"] for r in report["results"]}
    assert sorted(rates) == ["hf", "llm", "server"] and min(rates.values()) > 0
    assert abs(report["llm_over_server"] - rates["llm"] / rates["server"]) < 1e-2 * report["llm_over_server"] + 1e-3
