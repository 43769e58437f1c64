"""scripts/bench/train_long.py on CPU with a tiny shape: the three methods (megacp's own model, the same
model as transformers builds it through megacp's trainer, and the ALST peer) run one length in child
processes (the ladder's logic is the same at any length); each step's loss is the mean next-token
cross-entropy of random ids under random weights, ln(vocab) to within the init's spread. ALST's search
over its configurations runs two of them in children, and its choices and skips over a ladder are
checked against a model of memory with no children at all."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from scripts.bench import harness as bh
from scripts.bench import train_long
from scripts.bench.train_long import TINY, AlstConfig, AlstSearch, search_configs
from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S


def test_the_methods_ladder_on_cpu(tmp_path):
    out = tmp_path / "long.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.train_long", "--tiny", "--device", "cpu", "--layers", "2",
                    "--seq-lens", "64", "--warmup", "0", "--steps", "1", "--concurrent", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=HANG_GUARD_S)
    report = json.loads(out.read_text())
    rows = report["results"]
    assert sorted((r["method"], r["seq"]) for r in rows) == [("alst", 64), ("hf", 64), ("megacp", 64)]
    for r in rows:
        assert "error" not in r, r
        assert math.isfinite(r["loss"]) and abs(r["loss"] - math.log(TINY["vocab_size"])) < 0.5, r
        assert r["tokens_per_s"] > 0 and 0 < r["host_rss_gib"] < 8 and r["dtype"] == "float32", r
    megacp = {r["seq"]: r for r in rows if r["method"] == "megacp"}
    alst = {r["seq"]: r for r in rows if r["method"] == "alst"}
    assert "2 layer inputs offloaded" in megacp[64]["plan"]
    assert alst[64]["alst_mlp_shards"] == 1 and alst[64]["alst_loss_shards"] == 1
    assert "offloads nothing on CPU" in alst[64]["note"] and alst[64]["alst_offloaded_gib"] == 0.0
    # the default configuration: DeepSpeed's keep_last_count=1, parameters on the host, torch's AdamW
    assert alst[64]["alst_config"] == "keep-last-1+offload-param" and alst[64]["alst_optimizer"] == "AdamW (fp32 states)"
    assert report["alst_configs"] == {"64": "keep-last-1+offload-param"}
    hf = {r["seq"]: r for r in rows if r["method"] == "hf"}
    assert hf[64]["loss_fn"] == "tiled_loss" and "2 layer inputs offloaded" in hf[64]["plan"]  # the same plan
    assert report["longest"] == {"megacp": 64, "hf": 64, "alst": 64}
    ratio = megacp[64]["tokens_per_s"] / alst[64]["tokens_per_s"]
    assert math.isclose(report["tokens_per_s_ratios"]["megacp/alst"]["64"], ratio, rel_tol=1e-2)
    ratio = hf[64]["tokens_per_s"] / megacp[64]["tokens_per_s"]
    assert math.isclose(report["tokens_per_s_ratios"]["hf/megacp"]["64"], ratio, rel_tol=1e-2)
    assert "--tiny" in report["command"] and report["host_ram_gib"] > 0 and report["deepspeed"]


def test_refused_megacp_section(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"activation_checkpointing": {"enabled": False, "offload": "cpu"}}))
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.train_long", "--tiny", "--device", "cpu",
                           "--megacp-config", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2 and "offload" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_both_loaders_read_one_checkpoint(tmp_path):
    """``--from-checkpoint``: the parent writes a random model's safetensors directory, megacp's loader
    and transformers' (``megacp.train --model DIR`` / ``--hf-native``) each read it, and their first
    steps on the same ids give one loss (the same weights, two implementations); ALST and a directory of
another shape are refused in one line."""
    out, ckpt = tmp_path / "long.json", tmp_path / "ckpt"
    base = [sys.executable, "-m", "scripts.bench.train_long", "--tiny", "--device", "cpu", "--layers", "2",
            "--seq-lens", "64", "--warmup", "0", "--steps", "1", "--from-checkpoint", str(ckpt)]
    subprocess.run([*base, "--methods", "megacp,hf", "--json", str(out)], cwd=ROOT, check=True, capture_output=True,
                   timeout=HANG_GUARD_S)
    report = json.loads(out.read_text())
    assert (ckpt / "model.safetensors").is_file() and report["checkpoint_write_s"] > 0
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"megacp", "hf"} and all("error" not in r for r in rows.values()), rows
    assert abs(rows["megacp"]["loss"] - math.log(TINY["vocab_size"])) < 0.5, rows
    assert math.isclose(rows["megacp"]["loss"], rows["hf"]["loss"], rel_tol=1e-5), rows
    proc = subprocess.run([*base, "--methods", "megacp,alst"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2 and "--from-checkpoint" in proc.stderr.strip().splitlines()[-1], proc.stderr
    other = [*base, "--methods", "megacp"]
    other[other.index("--layers") + 1] = "3"  # the directory holds 2 layers
    proc = subprocess.run(other, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("num_hidden_layers 2 (the shape's: 3)"), proc.stderr


def test_alst_search_keeps_the_fastest_configuration(tmp_path):
    """``--alst-search`` with two configurations: each runs in its own child, the length's row is the
    faster one's, and it lists both attempts."""
    out = tmp_path / "search.json"
    subprocess.run([sys.executable, "-m", "scripts.bench.train_long", "--tiny", "--device", "cpu", "--layers", "2",
                    "--seq-lens", "64", "--warmup", "0", "--steps", "1", "--methods", "alst",
                    "--alst-search", "offload-all,no-offload+offload-param", "--json", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=HANG_GUARD_S)
    report = json.loads(out.read_text())
    [row] = report["results"]
    assert row["method"] == "alst" and row["seq"] == 64 and "error" not in row, row
    assert abs(row["loss"] - math.log(TINY["vocab_size"])) < 0.5, row
    tried = {t["alst_config"]: t for t in row["alst_tried"]}
    assert list(tried) == ["offload-all", "no-offload+offload-param"] and row["alst_skipped"] == [], row
    assert all(t["tokens_per_s"] > 0 and "error" not in t for t in tried.values()), tried
    fastest = max(tried.values(), key=lambda t: t["tokens_per_s"])
    assert row["alst_config"] == fastest["alst_config"] and row["tokens_per_s"] == fastest["tokens_per_s"]
    assert report["longest"] == {"alst": 64} and report["alst_configs"] == {"64": row["alst_config"]}


def test_alst_search_skips_what_cannot_fit(monkeypatch):
    """The search over a ladder with a model of memory in place of the children (4 layers; per unit of
    length, each input kept on the GPU takes 1 of its 5 units and parameters there 2; each input on
    the host 1 of its 5 and parameters there 2; more on the GPU is faster): the fastest configuration
    that fits is kept, a failed one is not tried again, and after a GPU out-of-memory none that holds at
    least as much on the GPU is tried."""
    calls = []

    def run_point(argv, method, seq, config):
        calls.append((seq, config.label))
        scale, kept = seq / 64, config.kept(4)
        gpu, host = scale * (kept + 2 * (not config.offload_param)), scale * (4 - kept + 2 * config.offload_param)
        row = {"method": method, "seq": seq, "alst_config": config.label}
        if gpu > 5:
            return {**row, "error": "oom", "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"}
        if host > 5:
            return {**row, "error": "host-oom", "message": "exit status -9"}
        return {**row, "tokens_per_s": 100 + 10 * kept + 5 * (not config.offload_param)}

    monkeypatch.setattr(train_long, "run_point", run_point)
    configs = search_configs(4)
    assert [c.label for c in configs] == [
        "offload-all+offload-param", "offload-all", "keep-last-1+offload-param", "keep-last-1",
        "keep-last-2+offload-param", "keep-last-2", "keep-last-3+offload-param", "keep-last-3",
        "no-offload+offload-param", "no-offload"]
    rows = bh.climb(AlstSearch([], configs, 4), [64, 96, 128])
    assert [r["seq"] for r in rows] == [64, 96, 128]
    # 64: all but the two extremes fit; parameters on the host with every input on the GPU is fastest
    assert rows[0]["alst_config"] == "no-offload+offload-param" and rows[0]["tokens_per_s"] == 140
    assert len(rows[0]["alst_tried"]) == 10 and rows[0]["alst_skipped"] == []
    # 96: the two that failed are skipped; keep-last-2's GPU OOM skips keep-last-3 (no-offload already failed)
    assert rows[1]["alst_config"] == "keep-last-3+offload-param" and rows[1]["tokens_per_s"] == 130
    assert rows[1]["alst_skipped"] == ["offload-all+offload-param", "keep-last-3", "no-offload"]
    assert [t["alst_config"] for t in rows[1]["alst_tried"] if "error" not in t] == ["keep-last-1",
                                                                                      "keep-last-3+offload-param"]
    # 128: only the two that ran at 96 are tried (neither holds as much on the GPU as one that ran out
    # of it there); both run out of GPU memory, which ends the ladder
    assert [t["alst_config"] for t in rows[2]["alst_tried"]] == ["keep-last-1", "keep-last-3+offload-param"]
    assert rows[2]["error"] == "oom" and rows[2]["message"] == "none of ALST's configurations trained 128 tokens (2 tried)"
    assert len(calls) == 10 + 7 + 2 and AlstConfig.parse("keep-last-3+offload-param") == AlstConfig(3, True)
