"""scripts/bench/train_long.py on CPU with a tiny shape: the three methods (megacp's own model, the same
model as transformers builds it through megacp's trainer, and the ALST peer) run one length in child processes (the ladder's logic is the same at any length); each step's loss is the mean next-token cross-entropy
of random ids under random weights, ln(vocab) to within the init's spread."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from scripts.bench.train_long import TINY
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
