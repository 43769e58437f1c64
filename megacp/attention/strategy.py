"""Choosing pass-KV or pass-Q per batch (the paper's Algorithm 1 with Algorithm 5's All2All term).

Pass-KV is chosen when its KV transfer hides behind compute,
``T >= N·C·NKV·e / (2·NH·BW)``, or when the cache miss rate is high enough,
``T/(T+P) >= 2·NKV/NH − 4·T·BW/(N·C·e)``; otherwise pass-Q. With GQA (NKV ≤ NH/2) a full
prefill (P = 0, miss rate 1) is always pass-KV; with MHA a short one can be pass-Q. A single new
token over a long cache is pass-Q. ``C`` (achieved attention FLOP/s of one rank) and ``BW`` (ring
link bandwidth, bytes/s) are measured by :func:`calibrate` and cached per device kind and CP size;
:data:`DEFAULTS` serve where no measurement exists. Every rank of a CP group must choose alike (the
ring hangs otherwise), so a group's ranks use one set of numbers: :func:`hardware_for` takes the
group's rank 0's on first use.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("megacp.strategy")

STRATEGIES = ("auto", "pass_kv", "pass_q")


@dataclass(frozen=True)
class Hardware:
    """Measured (or default) speeds: ``flops`` = C in FLOP/s per rank, ``bandwidth`` = BW in bytes/s."""

    flops: float
    bandwidth: float
    source: str = "default"


DEFAULTS = {
    "cuda": Hardware(flops=550e12, bandwidth=300e9),  # H200 cuDNN bf16 causal, NVLink one way
    "cpu": Hardware(flops=20e9, bandwidth=2e9),
}


@dataclass(frozen=True)
class Choice:
    """The decision and every input it was made from (loggable)."""

    strategy: str
    new_tokens: int
    cached_tokens: int
    num_heads: int
    num_kv_heads: int
    cp_size: int
    elem_bytes: int
    flops: float
    bandwidth: float
    hide_threshold: float
    miss_rate: float
    miss_threshold: float


def choose_strategy(
    new_tokens: int,
    cached_tokens: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    cp_size: int,
    elem_bytes: int,
    hw: Hardware,
) -> Choice:
    """Apply Algorithm 1/5. ``new_tokens`` = T and ``cached_tokens`` = P summed over the batch."""
    t, p, n = new_tokens, cached_tokens, cp_size
    c, bw, e = hw.flops, hw.bandwidth, elem_bytes
    hide = n * c * num_kv_heads * e / (2 * num_heads * bw)
    miss = t / (t + p) if t + p else 1.0
    miss_thr = 2 * num_kv_heads / num_heads - 4 * t * bw / (n * c * e)
    strategy = "pass_kv" if (t >= hide or miss >= miss_thr) else "pass_q"
    return Choice(strategy, t, p, num_heads, num_kv_heads, n, e, c, bw, hide, miss, miss_thr)


def _cache_path(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``calibration.json`` in ``cache_dir`` (``None``: ``~/.cache/megacp``)."""
    root = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "megacp")
    return Path(root) / "calibration.json"


def _kind(device: torch.device) -> str:
    """:data:`DEFAULTS` key of ``device``."""
    return "cuda" if device.type == "cuda" else "cpu"


def _device_key(device: torch.device, cp_size: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{name}|cp{cp_size}"


_agreed: dict[str, Hardware] = {}
"""This process's numbers by :func:`_device_key`, agreed with its CP group (or measured by
:func:`calibrate` over it): once set, every later strategy choice of the group reads the same entry."""


def _read_cache(path: Path) -> dict:
    """The calibration cache at ``path``; ``{}`` when absent, and ``{}`` with a warning when it is
    corrupt (it is then rebuilt by the next :func:`calibrate`)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("ignoring the corrupt calibration cache %s (%s); it is rebuilt by the next calibration", path, err)
        return {}
    if not isinstance(data, dict):
        log.warning("ignoring the corrupt calibration cache %s (not a JSON object)", path)
        return {}
    return data


def _from_file(key: str, cache_dir: str | os.PathLike[str] | None) -> Hardware | None:
    path = _cache_path(cache_dir)
    entry = _read_cache(path).get(key)
    if entry is None:
        return None
    try:
        return Hardware(**entry)
    except TypeError:
        log.warning("ignoring the corrupt entry %r of the calibration cache %s", key, path)
        return None


def hardware_for(device: torch.device, cp_size: int, group: dist.ProcessGroup | None = None, *,
                 cache_dir: str | os.PathLike[str] | None = None) -> Hardware:
    """C and BW for this device kind and CP size: measured by :func:`calibrate` in this process,
    else this host's cached calibration, else :data:`DEFAULTS`.

    With ``group`` (the CP group, more than one rank), the first lookup is collective: every rank
    takes the group's rank 0's numbers (one object broadcast) and keeps them, so ranks whose hosts
    cache different calibrations (or none) still make the same choice. Call it on every rank of the
    group at the same point (as a prefill step does)."""
    key = _device_key(device, cp_size)
    if key in _agreed:
        return _agreed[key]
    hw = _from_file(key, cache_dir) or DEFAULTS[_kind(device)]
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return hw
    box = [hw]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=device if device.type == "cuda" else None)
    _agreed[key] = box[0]
    return box[0]


def calibrate(group: dist.ProcessGroup | None, device: torch.device, *, tokens: int | None = None,
              heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
              save: bool = True, cache_dir: str | os.PathLike[str] | None = None) -> Hardware:
    """Measure C (one dense attention block) and BW (one ring hop) on this hardware; collective
    over ``group`` (``None`` = the whole world). Every rank gets the slowest rank's numbers and
    uses them for the rest of the process (:func:`hardware_for`); the group's rank 0 also caches
    them in ``calibration.json`` of ``cache_dir`` (default ``~/.cache/megacp``; a job's is
    ``runtime.calibration_cache_dir`` / ``MEGACP_CACHE_DIR``). The block's shape defaults
    to 4096 tokens, 32/8 heads of 128 on GPUs and 512 tokens, 8/2 heads of 64 on CPUs. With one
    rank there is no link to measure: BW keeps its default."""
    from megacp.attention.kernels.partial import partial_attention
    from megacp.parallel.ring import Ring

    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens = tokens or (4096 if gpu else 512)
    heads, kv_heads, head_dim = heads or (32 if gpu else 8), kv_heads or (8 if gpu else 2), head_dim or (128 if gpu else 64)
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    kv = torch.randn(2, tokens, kv_heads, head_dim, device=device, dtype=dtype)

    def timed(fn, reps: int = 3) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    sec = timed(lambda: partial_attention(q, kv[0], kv[1]))
    flops = 4 * tokens * tokens * heads * head_dim / sec
    ring = Ring(group)
    bw = math.inf
    if ring.size > 1:
        big = torch.empty(16 * 2**20 // kv.element_size(), dtype=dtype, device=device)
        recv = torch.empty_like(big)
        sec = timed(lambda: Ring.wait(ring.start(big, recv)))
        bw = big.numel() * big.element_size() / sec
    vals = torch.tensor([flops, bw], dtype=torch.float64, device=device)
    if ring.size > 1:
        dist.all_reduce(vals, op=dist.ReduceOp.MIN, group=ring.group)
    measured_bw = math.isfinite(vals[1])
    hw = Hardware(float(vals[0]), float(vals[1]) if measured_bw else DEFAULTS[_kind(device)].bandwidth,
                  "measured" if measured_bw else "measured C, default BW")
    _agreed[_device_key(device, ring.size)] = hw
    if save and ring.rank == 0:
        path = _cache_path(cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[_device_key(device, ring.size)] = asdict(hw)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    log.info("calibrated %s: C=%.3g FLOP/s, BW=%.3g B/s", device, hw.flops, hw.bandwidth)
    return hw
