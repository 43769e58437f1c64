"""The benchmark harness (``scripts/bench/harness``) and the benchmarks on one CPU process.

The harness's float64 reference, the peers' row layouts and the source digest against independent
answers; then ``python -m scripts.bench.prefill`` as a user runs it and the decode benchmark's
``main`` (gloo, world of one, the reference kernels, ``--check``): their JSON holds a timed row per
method and only passing checks; bad options stop with status 2 and one line.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megacp.placement import ShardPlan
from scripts.bench import decode, prefill
from scripts.bench import harness as bh
from tests.helpers.paths import ROOT
from tests.helpers.reference import naive_attention
from tests.helpers.timeouts import HANG_GUARD_S

SMALL = ["--device", "cpu", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--max-iters", "3",
         "--target-s", "0.01"]


def run_module(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m <module> ARGS`` from the repository root, one CPU process, no GPU."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=HANG_GUARD_S)


def test_sizes_and_labels() -> None:
    assert bh.parse_sizes("16384, 64K,1M,") == [16384, 65536, 1 << 20]
    assert [bh.size_label(n) for n in (16384, 1 << 20, 1000)] == ["16K", "1M", "1000"]
    with pytest.raises(ValueError, match="'12Q'"):
        bh.parse_sizes("12Q")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_load_balanced_index_is_megacps_placement(n: int) -> None:
    s = 24 * n
    for r in range(n):
        assert torch.equal(bh.load_balanced_index(s, n, r), ShardPlan([0], [s], n, r).local_index(r))
    rows = torch.cat([bh.contiguous_index(s, n, r) for r in range(n)])
    assert torch.equal(rows, torch.arange(s))


def test_truth_rows_is_exact_bottom_right_causal_gqa_attention() -> None:
    g = torch.Generator().manual_seed(0)
    lq, lk, hq, hkv, d = 7, 19, 4, 2, 8
    q, k, v = (torch.randn(n, h, d, generator=g) for n, h in ((lq, hq), (lk, hkv), (lk, hkv)))
    rows = torch.tensor([0, 3, 6])
    ref = naive_attention(q, k, v, q_positions=torch.arange(lq) + lk - lq, k_positions=torch.arange(lk))
    got = bh.truth_rows(q, k, v, rows, causal=True, chunk=2)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), ref[rows], rtol=1e-5, atol=1e-6)


def test_diff_stats_and_tolerance() -> None:
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert bh.diff_stats(a, a + torch.tensor([[0.0, 0.5], [0.0, -1.0]])) == {"max_abs": 1.0, "mean_abs": 0.375}
    assert bh.diff_stats(a, a * float("nan"))["max_abs"] != bh.diff_stats(a, a * float("nan"))["max_abs"]  # NaN
    assert bh.tolerance(a, 0.01, torch.float32) == pytest.approx(0.04 + 1e-4)
    assert bh.tolerance(torch.tensor([3.0]), None, torch.bfloat16) == pytest.approx(2 * 2.0**-7 * 2)


def test_sources_digest_names_the_code(tmp_path: Path) -> None:
    pkg = tmp_path / "megacp"
    shutil.copytree(ROOT / "megacp", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert bh.sources_digest(pkg) == bh.sources_digest()
    (pkg / "config.py").write_text((pkg / "config.py").read_text() + "\n# changed\n")
    assert bh.sources_digest(pkg) != bh.sources_digest()


def test_prefill_benchmark_on_one_cpu_process(tmp_path: Path) -> None:
    out = tmp_path / "prefill.json"
    proc = run_module("scripts.bench.prefill", *SMALL, "--seqlens", "64,96", "--check", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    methods = {(r["seqlen"], r["method"]) for r in data["results"]}
    for s in (64, 96):
        assert {(s, m) for m in ("single_reference", "megacp_pass_kv", "megacp_pass_q")} <= methods
    assert data["checks"] and all(c["ok"] for c in data["checks"])
    assert {x["method"] for x in data["skipped"]} == {"torch_cp", "te", "ds_ulysses"}  # CUDA-only peers
    assert len(data["meta"]["megacp_sha256"]) == 16 and data["meta"]["cp_size"] == 1
    assert "megacp check: ok" in proc.stdout


def test_decode_benchmark_on_one_cpu_process(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    assert decode.main([*SMALL, "--batches", "1,2", "--lengths", "256", "--check", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["results"]} >= {"single_reference", "megacp_reference_eager"}
    assert data["checks"] and all(c["ok"] for c in data["checks"])


@pytest.mark.parametrize("args,message", [
    (["--methods", "single,bogus"], "unknown --methods ['bogus']"),
    (["--seqlens", "4X"], "--seqlens: size '4X'"),
    (["--transports", "nccl_hp"], "nccl_hp needs NCCL"),
])
def test_bad_prefill_options_stop_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        prefill.parse_args(["--device", "cpu", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err


def test_window_benchmark_on_one_cpu_process(tmp_path: Path) -> None:
    """``scripts.bench.window --tiny``: every (mask, layout, pass) row is timed, and the work ratio it
    prints is the count of (query, key) pairs of an explicit causal mask over the windowed one."""
    out = tmp_path / "window.json"
    proc = run_module("scripts.bench.window", "--tiny", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["mask"], r["layout"], r["pass"]) for r in data["results"] if "mask" in r}
    assert rows == {(m, layout, p) for m in ("full", "window") for layout, p in
                    (("cp1", "fwd"), ("cp1", "fwd_bwd"), ("cp2_rank0", "fwd_bwd"), ("cp2_rank1", "fwd_bwd"))}
    s, w = data["meta"]["seqlen"], data["meta"]["window"]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    causal = j <= i
    work = int(causal.sum()) / int((causal & (j > i - w)).sum())
    assert [r["layout"] for r in data["ratios"]] == ["cp1", "cp1", "cp2_slowest"]
    for r in data["ratios"]:
        assert r["work_ratio"] == pytest.approx(work, rel=1e-12) and r["speedup"] == pytest.approx(r["full_ms"] / r["window_ms"])
    assert "speed-up of the window" in proc.stdout


@pytest.mark.slow
def test_train_feed_benchmark_on_one_cpu_process(tmp_path: Path) -> None:
    """``scripts.bench.train_feed --tiny``: ``megacp.train`` (no launcher) and the in-memory Trainer
    each time 5 steady steps; the corpus run's step times are its ``--metrics`` seconds, and the
    ratio and spread follow from the rows."""
    out, work = tmp_path / "feed.json", tmp_path / "work"
    proc = run_module("scripts.bench.train_feed", "--tiny", "--workdir", str(work), "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["feed"]: r for r in data["results"]}
    assert sorted(rows) == ["corpus", "memory"] and all(r["steps"] == 5 for r in rows.values())
    metrics = [json.loads(line)["seconds"] for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert rows["corpus"]["step_s"] == metrics[1:]
    for r in rows.values():
        assert r["tokens_per_s"] == pytest.approx(128 / statistics.median(r["step_s"]))
        assert r["spread"] == pytest.approx(max(r["step_s"]) / statistics.median(r["step_s"]))
    assert data["summary"]["ratio"] == pytest.approx(rows["corpus"]["tokens_per_s"] / rows["memory"]["tokens_per_s"])
    assert "megacp.train: 6 steps, loss" in proc.stdout and "corpus / memory tokens/s" in proc.stdout
    # each step's attention work: its sequence's document pieces (one token per word, plus EOS), packed here
    lengths = [len(json.loads(line)["text"].split()) + 1 for line in (work / "corpus.jsonl").read_text().splitlines()]
    pieces, room, works = [], 128, []
    for n in lengths * 2:
        while n:
            take = min(n, room)
            pieces, room, n = pieces + [take], room - take, n - take
            if room == 0:
                works, pieces, room = works + [sum(p * p for p in pieces) / 128**2], [], 128
    assert rows["memory"]["attention_work"] == rows["corpus"]["attention_work"] == pytest.approx(works[1:6])
    variants = {r["feed"]: r for r in data["diagnosis"]["variants"]}
    assert sorted(variants) == ["memory_fixed_work", "memory_gc_off", "memory_gc_unfrozen"]
    assert all(r["steps"] == 2 and len(r["gc_s"]) == 2 for r in variants.values())
    assert variants["memory_fixed_work"]["attention_work"] == pytest.approx([max(works[1:6])] * 2)
    assert variants["memory_gc_off"]["gc_full"] == [0, 0]
