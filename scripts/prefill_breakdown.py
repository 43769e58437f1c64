#!/usr/bin/env python3
"""Where pass-KV prefill time goes, per rank, against the zero-communication bound (2 GPUs).

    torchrun --nproc_per_node 2 scripts/prefill_breakdown.py --seqlens 16K,64K

For each length, every rank times (CUDA events, back-to-back calls, median of repeats):

* ``tiles``        — its kernel calls alone (step 0 on its own block, step 1 on its own block
  standing in for the received one), no merge, no communication: the zero-communication bound;
* ``tiles+merge``  — the same through ``run_tiles`` with the running-state merge;
* ``pass_kv[T]``   — ``cp_prefill`` with ring transport T (the real thing);
* each kernel alone (step-0 and step-1 tiles, the merge).

Efficiencies are T1 / (2 · t) against single-GPU cuDNN over the whole sequence (rank 0). Where
NVML is available (``torch.cuda.clock_rate`` / ``power_draw``), each line also gives the mean SM
clock (MHz) and board power (W) sampled during the timed calls, to tell a power-capped slowdown
from exposed transfer time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

from megacp.attention import ShardPlan, build_kv_block, cp_prefill, partial_attention  # noqa: E402
from megacp.attention.merge import merge_into  # noqa: E402
from megacp.attention.tiles import run_tiles  # noqa: E402
from megacp.parallel.ring import Ring  # noqa: E402


class Sampler:
    """Mean SM clock (MHz) and power (W) of this GPU while the ``with`` block runs (NVML, every 5 ms);
    ``None`` where NVML is unavailable."""

    def __init__(self) -> None:
        self.clock: float | None = None
        self.power: float | None = None
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))

    def __enter__(self) -> "Sampler":
        try:
            torch.cuda.clock_rate(), torch.cuda.power_draw()
        except Exception:  # noqa: BLE001 - no pynvml / NVML: no samples
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._samples:
                self.clock = statistics.mean(c for c, _ in self._samples)
                self.power = statistics.mean(p for _, p in self._samples)


SAMPLES: dict[str, Sampler] = {}


def timed(fn, reps: int = 7, calls: int = 5, collective: bool = True, key: str | None = None) -> float:
    """Median over ``reps`` of the mean ms of ``calls`` back-to-back calls (after a barrier of every
    rank when ``collective``; a rank-local measurement must pass ``collective=False``). With
    ``key``, the clock and power during the calls are kept in ``SAMPLES[key]``."""
    fn()
    out = []
    sampler = Sampler()
    with sampler if key is not None else contextlib.nullcontext():
        for _ in range(reps):
            torch.cuda.synchronize()
            if collective:
                torch.distributed.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / calls)
    if key is not None:
        SAMPLES[key] = sampler
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="16K,64K")
    p.add_argument("--transports", default="nccl,copy_engine")
    args = p.parse_args()
    ctx = bc.init_dist("cuda", None)
    n, r = ctx.world, ctx.rank
    h, hkv, d = 32, 8, 128
    rings = {t: Ring(ctx.group, transport=t) for t in bc.parse_names(args.transports)}
    for s in bc.parse_sizes(args.seqlens):
        q = bc.shared_randn((s, h, d), ctx, 1)
        k = bc.shared_randn((s, hkv, d), ctx, 2)
        v = bc.shared_randn((s, hkv, d), ctx, 3)
        t1 = None
        if r == 0:
            t1 = timed(lambda: partial_attention(q, k, v, causal=True, backend="cudnn"), reps=5, calls=3, collective=False) if s <= 65536 else None
        plan = ShardPlan([0], [s], n, r)
        idx = plan.local_index().to(ctx.device)
        ql, kl, vl = q[idx], k[idx], v[idx]
        block = build_kv_block(plan, kl, vl)
        tiles0, tiles1 = plan.tiles(r, r), plan.tiles(r, (r - 1) % n)
        res: dict[str, float] = {}

        def kernels():
            for tiles in (tiles0, tiles1):
                for t in tiles:
                    partial_attention(ql[t.q0:t.q1], block[0, t.k0:t.k1], block[1, t.k0:t.k1], causal=t.causal)

        def with_merge():
            st = run_tiles(ql, block[0], block[1], tiles0, None)
            run_tiles(ql, block[0], block[1], tiles1, st)

        SAMPLES.clear()
        res["tiles"] = timed(kernels, key="tiles")
        res["tiles+merge"] = timed(with_merge, key="tiles+merge")
        for name, ring in rings.items():
            res[f"pass_kv[{name}]"] = timed(lambda ring=ring: cp_prefill(ql, block, plan, ring, strategy="pass_kv"),
                                            key=f"pass_kv[{name}]")
        for i, tiles in enumerate((tiles0, tiles1)):
            for t in tiles:
                res[f"step{i} {'causal' if t.causal else 'dense'} {t.q1 - t.q0}x{t.k1 - t.k0}"] = timed(
                    lambda t=t: partial_attention(ql[t.q0:t.q1], block[0, t.k0:t.k1], block[1, t.k0:t.k1], causal=t.causal))
        st = run_tiles(ql, block[0], block[1], tiles0, None)
        o, l_ = run_tiles(ql, block[0], block[1], tiles1, None)
        rows = sum(t.q1 - t.q0 for t in tiles1)
        res[f"merge_into {rows} rows"] = timed(lambda: merge_into(st[0][:rows].clone(), st[1][:rows].clone(), o[:rows], l_[:rows]))
        res[f"  (clone of the inputs, subtract) {rows}"] = timed(lambda: (st[0][:rows].clone(), st[1][:rows].clone()))
        t1 = bc.all_max(ctx, [t1 or 0.0])[0]
        for rk in range(n):
            if rk == r:
                print(f"\n=== S={bc.size_label(s)} rank {r}  (single cuDNN T1 = {t1:.3f} ms)", flush=True)
                for key, ms in res.items():
                    eff = t1 / (n * ms) if t1 and not key.startswith(("step", "merge", "  ")) else None
                    smp = SAMPLES.get(key)
                    clk = f"   {smp.clock:6.0f} MHz {smp.power:5.0f} W" if smp is not None and smp.clock else ""
                    print(f"  {key:36s} {ms:9.4f} ms" + (f"   eff {eff:.3f}" if eff else "") + clk, flush=True)
            torch.distributed.barrier()
        del q, k, v, ql, kl, vl, block
        bc.free(ctx)
    bc.finish(ctx)


if __name__ == "__main__":
    main()
