"""Shared helpers of the GPU benchmarks and the GPU verification (``bench_prefill.py``,
``bench_decode.py``, ``gpu_verify.py``): process group set-up, timing, data, errors, output.

Timing rules (every script):

* CUDA events on CUDA (``time.perf_counter`` on CPU), one event pair per call;
* a barrier (all-reduce + device synchronise, so every rank's host and device are idle) before
  each timed call of a collective method;
* the time of a call is the maximum over the ranks (all-reduce MAX of the per-call times), the
  reported time is the median of the calls; warm-up calls are never counted;
* the number of timed calls adapts to the call's length (``target_s``), the same on every rank.

Single-GPU baselines run on one rank alone (``collective=False``); the other ranks wait at the
next barrier.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # megacp importable from a plain checkout (no install)
    sys.path.insert(0, str(REPO))

# torch >= 2.12 names it all_gather_single (and deprecates the old name); 2.4-2.11 only have the old one
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


# --------------------------------------------------------------------------- arguments


def parse_sizes(text: str) -> list[int]:
    """``"16384,64K,1M"`` → ``[16384, 65536, 1048576]`` (K = 1024, M = 1024²)."""
    out = []
    for tok in text.split(","):
        tok = tok.strip().upper()
        if not tok:
            continue
        mult = {"K": 1024, "M": 1024 ** 2}.get(tok[-1], 1)
        out.append(int(tok[:-1] if mult > 1 else tok) * mult)
    return out


def parse_names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def size_label(n: int) -> str:
    if n % (1024 ** 2) == 0:
        return f"{n // 1024 ** 2}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def add_common_args(p) -> None:
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (NCCL) or cpu (gloo, for smoke tests; kernels become the reference path)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on cuda) / float16 / float32 (default on cpu)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="write the results as JSON to this path (rank 0)")
    p.add_argument("--pg-timeout", type=float, default=300.0,
                   help="process-group timeout in seconds (a hung collective fails instead of eating the budget)")


# --------------------------------------------------------------------------- process group


@dataclass
class Ctx:
    """This process's place: rank, world, device, the CP group (the whole world)."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    dtype: torch.dtype
    backend: str
    group: Any = None
    _bar: torch.Tensor | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, *args: Any) -> None:
        if self.rank == 0:
            print(*args, flush=True)


def init_dist(device: str, dtype: str | None, timeout_s: float = 300.0) -> Ctx:
    """Join the torchrun world (a world of one when started without torchrun)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but CUDA is not available (use --device cpu for a smoke test)")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(world, 1)))
    kw: dict[str, Any] = dict(backend=backend, timeout=timedelta(seconds=timeout_s))
    if backend == "nccl":
        kw["device_id"] = dev  # eager NCCL init, bound to this device
    try:
        dist.init_process_group(**kw)
    except TypeError:  # an older torch without device_id
        kw.pop("device_id", None)
        dist.init_process_group(**kw)
    dt = DTYPES[dtype] if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    ctx = Ctx(rank, world, local, dev, dt, backend, dist.group.WORLD)
    ctx._bar = torch.zeros(1, device=dev)
    if dev.type == "cuda":  # no TF32 anywhere (fp32 references must be fp32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return ctx


def finish(ctx: Ctx) -> None:
    try:
        barrier(ctx)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def barrier(ctx: Ctx) -> None:
    """Every rank's host and device reach this point before any leaves it."""
    sync(ctx)
    if ctx.world > 1:
        dist.all_reduce(ctx._bar, group=ctx.group)
        sync(ctx)


def all_max(ctx: Ctx, values: Sequence[float]) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    if ctx.world > 1 and t.numel():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return t.tolist()


def agree(ctx: Ctx, ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    return all_max(ctx, [0.0 if ok else 1.0])[0] == 0.0


def bcast_obj(ctx: Ctx, obj: Any, src: int = 0) -> Any:
    if ctx.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=ctx.group, device=ctx.device if ctx.cuda else None)
    return box[0]


def free(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- timing


class Clock:
    """Milliseconds of GPU work between ``start()`` and ``stop()`` (wall time on CPU)."""

    def __init__(self, ctx: Ctx) -> None:
        self.cuda = ctx.cuda
        if self.cuda:
            self.a = torch.cuda.Event(enable_timing=True)
            self.b = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.a.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.b.record()
            self.b.synchronize()
            return self.a.elapsed_time(self.b)
        return (time.perf_counter() - self.t0) * 1e3


@dataclass
class Timing:
    ms: float  # median over the timed calls (each the max over ranks)
    min_ms: float
    max_ms: float
    iters: int
    times_ms: list[float] = field(default_factory=list)
    loop_ms: float | None = None  # per call of back-to-back calls (``measure(loop_calls=)``)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["times_ms"] = [round(t, 4) for t in self.times_ms]
        return d


def measure(ctx: Ctx, fn: Callable[[], Any], *, collective: bool = True, warmup: int = 2,
            min_iters: int = 3, max_iters: int = 20, target_s: float = 2.0, loop_calls: int = 0) -> Timing:
    """Time ``fn`` (see the module docstring). ``collective=False``: only the calling rank runs it
    (no barrier, no reduction); the other ranks must not call this. ``loop_calls > 0`` also times
    that many back-to-back calls (:func:`measure_loop`, at most ``target_s`` worth of them): how
    the call runs when the host queues it ahead, as layers of a model do."""
    clock = Clock(ctx)
    pre = (lambda: barrier(ctx)) if collective else (lambda: sync(ctx))
    est = 0.0
    for _ in range(max(warmup, 1)):
        pre()
        clock.start()
        fn()
        est = clock.stop()
    if collective:
        est = all_max(ctx, [est])[0]
    iters = int(min(max_iters, max(min_iters, math.floor(target_s * 1e3 / max(est, 1e-3)))))
    times = []
    for _ in range(iters):
        pre()
        clock.start()
        fn()
        times.append(clock.stop())
    if collective:
        times = all_max(ctx, times)
    loop = None
    if loop_calls > 0:
        loop = measure_loop(ctx, fn, calls=min(loop_calls, max(2, iters)), collective=collective)
    return Timing(statistics.median(times), min(times), max(times), iters, times, loop)


def measure_loop(ctx: Ctx, fn: Callable[[], Any], *, calls: int = 20, collective: bool = True) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls (no sync between them), max over ranks."""
    clock = Clock(ctx)
    fn()
    (barrier if collective else sync)(ctx)
    clock.start()
    for _ in range(calls):
        fn()
    ms = clock.stop() / calls
    return all_max(ctx, [ms])[0] if collective else ms


def capture_graph(ctx: Ctx, fn: Callable[[], Any], warmup: int = 3):
    """Warm ``fn`` up on a side stream, then capture one call into a CUDA graph (every rank together:
    NCCL collectives inside are captured, not run). Returns ``(graph, static output)``; replay with
    ``graph.replay()``. ``thread_local`` capture: NCCL's watchdog thread may query events meanwhile."""
    side = torch.cuda.Stream(device=ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    barrier(ctx)
    g = torch.cuda.CUDAGraph()
    try:
        cm = torch.cuda.graph(g, capture_error_mode="thread_local")
    except TypeError:  # torch without capture_error_mode
        cm = torch.cuda.graph(g)
    with cm:
        out = fn()
    barrier(ctx)
    return g, out


# --------------------------------------------------------------------------- data


def randn(shape: Sequence[int], ctx: Ctx, seed: int, *, scale: float = 1.0) -> torch.Tensor:
    """Deterministic normal data made on this rank's device (then cast to ``ctx.dtype``)."""
    g = torch.Generator(device=ctx.device)
    g.manual_seed(seed)
    t = torch.randn(*shape, generator=g, device=ctx.device, dtype=torch.float32 if not ctx.cuda else ctx.dtype)
    if scale != 1.0:
        t.mul_(scale)
    return t.to(ctx.dtype)


def shared_randn(shape: Sequence[int], ctx: Ctx, seed: int) -> torch.Tensor:
    """The same tensor on every rank: made on rank 0, broadcast (never relies on equal RNG streams)."""
    t = randn(shape, ctx, seed) if ctx.rank == 0 else torch.empty(*shape, dtype=ctx.dtype, device=ctx.device)
    if ctx.world > 1:
        dist.broadcast(t, src=0, group=ctx.group)
    return t


def gather_rows(ctx: Ctx, local: torch.Tensor, indices: Sequence[torch.Tensor], total: int) -> torch.Tensor:
    """Reassemble a row-sharded tensor on every rank.

    Args:
        local: ``[n_local, ...]`` this rank's rows; indices: ``indices[j]`` the global row of each of
            rank j's rows (any order, possibly different counts); total: number of global rows.
    """
    n_max = max(int(ix.numel()) for ix in indices)
    pad = local.new_zeros((n_max, *local.shape[1:]))
    pad[: local.shape[0]] = local
    out_all = torch.empty((ctx.world * n_max, *local.shape[1:]), dtype=local.dtype, device=local.device)
    if ctx.world > 1:
        _all_gather_single(out_all, pad.contiguous(), group=ctx.group)
    else:
        out_all.copy_(pad)
    out_all = out_all.view(ctx.world, n_max, *local.shape[1:])
    full = local.new_empty((total, *local.shape[1:]))
    for j, ix in enumerate(indices):
        full[ix.to(local.device)] = out_all[j, : ix.numel()]
    return full


# --------------------------------------------------------------------------- errors


def diff_stats(a: torch.Tensor, b: torch.Tensor, *, chunk_rows: int = 4096) -> dict:
    """Max / mean absolute difference of two same-shape tensors (fp32, row chunks, no big temporaries);
    ``nan`` when either has a non-finite value."""
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    mx, tot, n, finite = 0.0, 0.0, 0, True
    for i in range(0, a.shape[0], chunk_rows):
        x, y = a[i:i + chunk_rows].float(), b[i:i + chunk_rows].float()
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            finite = False
            break
        d = (x - y).abs()
        mx = max(mx, d.max().item())
        tot += d.sum().item()
        n += d.numel()
    if not finite:
        return {"max_abs": float("nan"), "mean_abs": float("nan")}
    return {"max_abs": mx, "mean_abs": tot / max(n, 1)}


def tolerance(ref: torch.Tensor, noise: float | None, dtype: torch.dtype) -> float:
    """Allowed ``max|cp - ref|``: 4× the kernels' disagreement (``noise``: flash vs cuDNN) plus a floor of
    2 units in the last place of ``ref``'s largest magnitude (half precision; 1e-4 for fp32)."""
    if dtype == torch.float32:
        floor = 1e-4
    else:
        mag = max(float(ref.abs().max()), 1e-30)
        floor = max(1e-3, 2 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(mag)))
    return 4 * (noise or 0.0) + floor


def truth_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, *,
               causal: bool = True, chunk: int = 8) -> torch.Tensor:
    """Exact attention (float64) of the queries ``q[rows]`` of one request.

    q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``; causal is bottom-right aligned (query i sees keys
    ``j <= i + Lk - Lq``), GQA maps query head h to KV head ``h // (Hq // Hkv)``.
    Returns ``[len(rows), Hq, D]`` float64.
    """
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    outs = []
    kd = k.double().permute(1, 0, 2)  # [Hkv, Lk, D]
    vd = v.double().permute(1, 0, 2)
    for i in range(0, rows.numel(), chunk):
        r = rows[i:i + chunk].to(q.device)
        qd = q[r].double().reshape(-1, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, n*G, D]
        s = torch.bmm(qd, kd.transpose(1, 2)) * scale  # [Hkv, n*G, Lk]
        if causal:
            lim = (r + (lk - lq)).repeat_interleave(g)  # [n*G]
            mask = torch.arange(lk, device=q.device)[None, :] > lim[:, None]
            s.masked_fill_(mask[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.bmm(p, vd)  # [Hkv, n*G, D]
        outs.append(o.reshape(hkv, -1, g, d).permute(1, 0, 2, 3).reshape(-1, hq, d))
    return torch.cat(outs)


def sample_rows(n: int, count: int, seed: int, *, edges: Sequence[int] = ()) -> torch.Tensor:
    """``count`` sorted row indices in ``[0, n)``: the given edges (and their neighbours) plus random rows."""
    pick = set()
    for e in list(edges) + [0, n - 1]:
        for x in (e - 1, e, e + 1):
            if 0 <= x < n:
                pick.add(x)
    g = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, n, (max(count - len(pick), 0),), generator=g).tolist()
    pick.update(extra)
    return torch.tensor(sorted(pick), dtype=torch.long)


# --------------------------------------------------------------------------- output


def env_info(ctx: Ctx) -> dict:
    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "world": ctx.world,
        "device": str(ctx.device), "dtype": str(ctx.dtype).replace("torch.", ""),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                "MEGACP_ATTN_BACKEND") if os.environ.get(k) is not None},
    }
    if ctx.cuda:
        info.update(gpu=torch.cuda.get_device_name(ctx.device), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    try:
        info["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        info["git"] = None
    # the code that ran, even where the checkout's git metadata is stale (a copied working tree)
    digest = hashlib.sha256()
    for path in sorted((REPO / "megacp").rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    info["megacp_sha256"] = digest.hexdigest()[:16]
    return info


class Report:
    """Results of one run: rows, skips, checks; rank 0 rewrites the JSON file after every change
    so that a run that dies later still leaves what it measured."""

    def __init__(self, ctx: Ctx, path: str | None, meta: dict) -> None:
        self.ctx, self.path = ctx, path
        self.data: dict[str, Any] = {"meta": meta, "results": [], "skipped": [], "checks": [], "errors": []}

    def _save(self) -> None:
        if self.ctx.rank != 0 or not self.path:
            return
        p = Path(self.path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        tmp.replace(p)

    def result(self, row: dict) -> None:
        self.data["results"].append(row)
        self._save()

    def skip(self, method: str, reason: str, **where: Any) -> None:
        self.data["skipped"].append({"method": method, "reason": reason, **where})
        self.ctx.log(f"  {method}: skipped: {reason}" + (f" ({where})" if where else ""))
        self._save()

    def check(self, row: dict) -> None:
        self.data["checks"].append(row)
        self._save()

    def error(self, method: str, exc: BaseException, **where: Any) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        self.data["errors"].append({"method": method, "error": msg[:2000], **where})
        # every rank reports (an error on one rank only would otherwise be invisible)
        print(f"  [rank {self.ctx.rank}] {method}: ERROR {msg[:500]}", flush=True)
        if self.ctx.rank == 0:
            traceback.print_exc(limit=6)
            sys.stdout.flush()
        self._save()

    def note(self, key: str, value: Any) -> None:
        self.data["meta"].setdefault("notes", {})[key] = value
        self._save()


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    return str(x)


def fmt(x: Any, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return format(x, spec)
    return str(x)


def print_table(ctx: Ctx, rows: list[dict], cols: list[tuple[str, str, str]], title: str = "") -> None:
    """``cols``: (key, header, format spec) — rank 0 prints a fixed-width table."""
    if ctx.rank != 0 or not rows:
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


def attn_flops(seqlen: int, heads: int, head_dim: int, *, causal: bool = True) -> float:
    """FLOPs of one attention forward over one sequence: ``4·S²·H·D``, halved when causal."""
    f = 4.0 * seqlen * seqlen * heads * head_dim
    return f / 2 if causal else f
