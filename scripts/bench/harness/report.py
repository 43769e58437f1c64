"""What a benchmark run writes: its environment (with a digest of the megacp sources that ran),
its rows, skips, checks and errors as JSON, and fixed-width tables on rank 0."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import megacp
from scripts.bench.harness.context import Ctx

ENV_VARS = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "MEGACP_ATTN_BACKEND", "MEGACP_RING_TRANSPORT",
            "MEGACP_PEER_WINDOW_MB")
"""Environment variables recorded with every run (when set)."""


def sources_digest(package: Path | None = None) -> str:
    """16 hex digits of SHA-256 over the path and bytes of every ``.py`` file of the megacp package:
    names the code that ran even where a copied checkout's git metadata is stale."""
    root = package or Path(megacp.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root.parent).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def env_info(ctx: Ctx) -> dict[str, Any]:
    """Versions, device, dtype, time, recorded environment variables, git commit and
    :func:`sources_digest` of this run."""
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "world": ctx.world,
        "device": str(ctx.device), "dtype": str(ctx.dtype).replace("torch.", ""),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }
    if ctx.cuda:
        info.update(gpu=torch.cuda.get_device_name(ctx.device), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    repo = Path(megacp.__file__).resolve().parent.parent
    try:
        info["git"] = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    info["megacp_sha256"] = sources_digest()
    return info


def _jsonable(x: Any) -> str:
    """JSON fallback: non-finite floats, dtypes, devices and anything else as their ``str``."""
    return str(x)


class Report:
    """Results of one run: rows, skips, checks, errors; rank 0 rewrites the JSON file after every
    change so that a run that dies later still leaves what it measured."""

    def __init__(self, ctx: Ctx, path: str | None, meta: dict[str, Any]) -> None:
        self.ctx, self.path = ctx, path
        self.data: dict[str, Any] = {"meta": meta, "results": [], "skipped": [], "checks": [], "errors": []}

    def save(self) -> None:
        """Write the JSON file (rank 0, when a path was given), atomically."""
        if self.ctx.rank != 0 or not self.path:
            return
        p = Path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        tmp.replace(p)

    def result(self, row: dict[str, Any]) -> None:
        self.data["results"].append(row)
        self.save()

    def skip(self, method: str, reason: str, **where: Any) -> None:
        self.data["skipped"].append({"method": method, "reason": reason, **where})
        self.ctx.log(f"  {method}: skipped: {reason}" + (f" ({where})" if where else ""))
        self.save()

    def check(self, row: dict[str, Any]) -> None:
        self.data["checks"].append(row)
        self.save()

    def error(self, method: str, exc: BaseException, **where: Any) -> None:
        """Record an exception; every rank prints it (an error on one rank only would otherwise be
        invisible), rank 0 with a short traceback."""
        msg = f"{type(exc).__name__}: {exc}"
        self.data["errors"].append({"method": method, "error": msg[:2000], **where})
        print(f"  [rank {self.ctx.rank}] {method}: ERROR {msg[:500]}", flush=True)
        if self.ctx.rank == 0:
            traceback.print_exc(limit=6)
            sys.stdout.flush()
        self.save()

    def note(self, key: str, value: Any) -> None:
        self.data["meta"].setdefault("notes", {})[key] = value
        self.save()

    def print_summary(self, check: str, *, checked: bool, failed: bool, where: tuple[str, ...]) -> None:
        """Rank 0 prints the skipped methods, the errors (with their ``where`` fields), the JSON path
        and the verdict line ``"<check> check: ok|FAIL|not run"``."""
        if self.ctx.rank != 0:
            return
        for sk in self.data["skipped"]:
            print(f"skipped: {sk['method']}: {sk['reason']}")
        for er in self.data["errors"]:
            at = ", ".join(f"{k}={er.get(k)}" for k in where)
            print(f"error: {er['method']} ({at}): {er['error'][:300]}")
        if self.path:
            print(f"JSON: {self.path}")
        print(f"{check} check: " + ("FAIL" if failed else "ok" if checked else "not run"), flush=True)


def fmt(x: Any, spec: str = ".3f") -> str:
    """A table cell: ``-`` for None, floats with ``spec`` (non-finite as text), the rest as ``str``."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec) if math.isfinite(x) else str(x)
    return str(x)


def print_table(ctx: Ctx | None, rows: list[dict], cols: list[tuple[str, str, str]], title: str = "") -> None:
    """``cols``: (key, header, format spec) — rank 0 (any process when ``ctx`` is ``None``) prints a
    fixed-width table."""
    if (ctx is not None and ctx.rank != 0) or not rows:
        return
    cells = [[fmt(r.get(k), spec) for k, _, spec in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(cols)]
    if title:
        print("\n" + title)
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(cols, widths))))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(c, widths))))
    sys.stdout.flush()
