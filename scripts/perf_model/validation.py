"""The cost model against the recorded 2× H200 runs in ``docs/results/``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from scripts.perf_model.decode import decode_time
from scripts.perf_model.generation import ttft
from scripts.perf_model.hardware import Machine
from scripts.perf_model.prefill import prefill_time
from scripts.perf_model.shapes import LLAMA3_8B, AttnShape

KiB, MiB = 2**10, 2**20

PREFILL_RUN = "prefill/h200x2_peers_cost_model_fit.json"
"""The prefill run the kernel rates and the NCCL call overhead were fitted to (every peer in the run)."""

DECODE_RUN = "decode/h200x2.json"
"""The decode run (fused Triton merge after the all-gather)."""

TTFT_RUN = "ttft/h200x2_llama3_8b_torchrun.json"
"""The TTFT run of the Llama-3-8B shape, CP=1 and CP=2 (``scripts/bench/generate.py``)."""


def ttft_rows(data: dict | list) -> list[dict]:
    """The rows of a ``scripts/bench/generate.py`` JSON: ``data["results"]``; the recorded TTFT runs
    predate its ``meta`` and are the bare list of rows."""
    return data["results"] if isinstance(data, dict) else data


@dataclass(frozen=True)
class Check:
    """One measured number next to the model's prediction.

    ``role`` is ``"fit"`` where the number calibrated a constant of the model, ``"pred"`` where it
    did not (a prediction)."""

    name: str
    measured_s: float
    predicted_s: float
    role: str

    @property
    def error(self) -> float:
        """Relative error of the prediction, (predicted − measured) / measured."""
        return self.predicted_s / self.measured_s - 1.0


_RING_NAMES = {"pass_kv": "pass-KV", "pass_q": "pass-Q"}


def _label(tokens: int) -> str:
    return f"{tokens // MiB}M" if tokens % MiB == 0 else f"{tokens // KiB}K"


def validate(m: Machine, results_dir: str | Path) -> list[Check]:
    """The model against the recorded 2-GPU runs in ``results_dir`` (``docs/results``):
    :data:`PREFILL_RUN`, :data:`DECODE_RUN`, :data:`TTFT_RUN`."""
    root = Path(results_dir)
    pre = json.loads((root / PREFILL_RUN).read_text())
    dec = json.loads((root / DECODE_RUN).read_text())
    gen = ttft_rows(json.loads((root / TTFT_RUN).read_text()))
    meta = pre["meta"]
    shape = AttnShape(meta["heads"], meta["kv_heads"], meta["head_dim"], 2)
    n = meta["cp_size"]
    checks: list[Check] = []
    by = {(r["seqlen"], r["method"]): r["ms"] * 1e-3 for r in pre["results"]}
    for s in meta["seqlens"]:
        one = prefill_time(m, shape, s, cp=1).total_s
        checks.append(Check(f"prefill 1 GPU {_label(s)}", by[s, "single_cudnn"], one, "fit"))
        for strat, role in (("pass_kv", "fit" if s == min(meta["seqlens"]) else "pred"), ("pass_q", "pred")):
            pred = prefill_time(m, shape, s, cp=n, strategy=strat).total_s
            checks.append(Check(f"prefill {_RING_NAMES[strat]} {_label(s)} CP{n}", by[s, f"megacp_{strat}"], pred, role))
    dmeta = dec["meta"]
    dshape = AttnShape(dmeta["heads"], dmeta["kv_heads"], dmeta["head_dim"], 2)
    dby = {(r["batch"], r["kv_len"], r["method"]): r["ms"] * 1e-3 for r in dec["results"]}
    for b in dmeta["batches"]:
        for kv in dmeta["lengths"]:
            for cp, method, what in ((1, "single_cudnn", "1 GPU"), (dmeta["cp_size"], "megacp_cudnn_graph", f"CP{dmeta['cp_size']} graph")):
                pred = decode_time(m, dshape, kv, b, cp=cp).total_s
                checks.append(Check(f"decode {what} B={b} {_label(kv)}", dby[b, kv, method], pred, "fit"))
    for row in gen:
        s = row["seqlen"]
        for cp, role in ((1, "fit"), (2, "pred")):
            pred = ttft(m, LLAMA3_8B, s, cp=cp).total_s
            checks.append(Check(f"TTFT Llama-3-8B CP{cp} {_label(s)}", row[f"cp{cp}_ttft_s"], pred, role))
    return checks
