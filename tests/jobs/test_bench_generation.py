"""scripts/bench/decode_kinds.py and scripts/bench/long_prompt.py on CPU with their tiny shapes: every
request kind runs in megacp and in transformers at the batch asked, and the long-prompt ladder runs
both methods in child processes (the logic is the same at any size; the GPU runs are the measurements)."""

from __future__ import annotations

import json
import subprocess
import sys

from scripts.bench.decode_kinds import KINDS
from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S


def test_decode_kinds_every_kind_on_cpu(tmp_path) -> None:
    out = tmp_path / "kinds.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.decode_kinds", "--tiny", "--batches", "2", "--new-tokens", "3",
                    "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=HANG_GUARD_S)
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["request"] for r in rows] == list(KINDS) and all(r["batch"] == 2 for r in rows)
    for r in rows:
        assert r["megacp_tok_s"] > 0 and "hf_tok_s" in r and r["megacp_decode"] == "static_eager", r
    assert not report.get("errors") and report["meta"]["hf_cache"] == "dynamic"
    assert report["checks"] == [{"model": "tiny", "batch": 2, "first_greedy_token_equal": True, "differing": 0,
                                 "near_ties": 0, "ok": True}]


def test_long_prompt_ladder_on_cpu(tmp_path) -> None:
    out = tmp_path / "long.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.long_prompt", "--tiny", "--device", "cpu", "--lengths", "48",
                    "--new-tokens", "3", "--json", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=HANG_GUARD_S)
    report = json.loads(out.read_text())
    rows = report["results"]
    assert sorted((r["method"], r["length"]) for r in rows) == [("hf", 48), ("megacp", 48)]
    for r in rows:
        assert "error" not in r and r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0, r
        assert r["peak_alloc_gib"] is None and 0 < r["host_rss_gib"] < 8, r
    assert [r["prefill_chunk"] for r in rows if r["method"] == "megacp"] == [48]  # CPU: whole prompts
    megacp = next(r for r in rows if r["method"] == "megacp")
    assert megacp["prefill_tflops"] >= 0 and megacp["capacity_tokens"] is None  # no GPU memory to size against
    assert report["megacp_longest_of_capacity"] is None
    assert report["longest"] == {"megacp": 48, "hf": 48} and set(report["megacp_over_hf_ttft"]) == {"48"}
    assert "--tiny" in report["command"]
