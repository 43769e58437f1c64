#!/usr/bin/env python3
"""Where pass-KV prefill time goes, per rank, against the zero-communication bound (2 GPUs).

    torchrun --nproc_per_node 2 -m scripts.diagnostics.prefill_breakdown --seqlens 16K,64K

For each length, every rank times (CUDA events, back-to-back calls, median of repeats; the first
three kinds round-robin, so drift of clock or temperature during the run hits them alike):

* ``tiles``        — its kernel calls alone (step 0 on its own block, step 1 on its own block
  standing in for the received one), no merge, no communication: the zero-communication bound;
* ``tiles+merge``  — the same through ``run_tiles`` with the running-state merge;
* ``tiles+copy[peer]`` / ``tiles+copy[local]`` — ``tiles`` with a copy of the local K and V on a
  side stream beside the kernels (no dependency), into the next rank's peer window (copy engine,
  NVLink: what the push transport moves) or into this GPU's own memory: what the transfer alone
  costs the kernels at the power cap;
* ``pass_kv[T]``   — ``cp_prefill`` with ring transport T (the real thing); for the copy engine
  also with the received blocks forced onto one stream / a second stream
  (``megacp.attention.pass_kv.SECOND_STREAM_MAX_ROWS``);
* each kernel alone (step-0 and step-1 tiles, the merge).

Efficiencies are T1 / (2 · t) against single-GPU cuDNN over the whole sequence (rank 0). Where
NVML is available (``torch.cuda.clock_rate`` / ``power_draw``), each line also gives the mean SM
clock (MHz) and board power (W) sampled during the timed calls, to tell a power-capped slowdown
from exposed transfer time.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch


from megacp.attention import build_kv_block, cp_prefill, partial_attention, pass_kv
from megacp.attention.kernels.merge import merge_into
from megacp.attention.kernels.tile_attention import run_tiles
from megacp.parallel.peer import peer_window
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan
from scripts.bench import harness as bh


def timed(fn: Callable[[], object], reps: int = 7, calls: int = 5) -> float:
    """Rank-local: median over ``reps`` of the mean ms of ``calls`` back-to-back calls (no collective)."""
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        out.append(bh.window_ms(fn, calls))
    return statistics.median(out)


def timed_interleaved(fns: dict[str, Callable[[], object]], reps: int = 7, calls: int = 5
                      ) -> tuple[dict[str, float], dict[str, bh.Sampler]]:
    """Every rank: the variants of ``fns`` measured round-robin (rep 1 of each, rep 2 of each, ...)
    after a barrier each, so clock or temperature drift during the run hits all of them alike.
    Returns the median ms of each and its clock/power samples."""
    samplers = {k: bh.Sampler() for k in fns}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            torch.cuda.synchronize()
            torch.distributed.barrier()
            with samplers[k]:
                times[k].append(bh.window_ms(fn, calls))
    return {k: statistics.median(v) for k, v in times.items()}, samplers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="16K,64K")
    p.add_argument("--transports", default="nccl,copy_engine")
    args = p.parse_args()
    ctx = bh.init("cuda", None)
    n, r = ctx.world, ctx.rank
    h, hkv, d = 32, 8, 128
    rings = {t: Ring(ctx.group, transport=t) for t in bh.parse_names(args.transports)}
    for s in bh.parse_sizes(args.seqlens):
        q = bh.shared_randn((s, h, d), ctx, 1)
        k = bh.shared_randn((s, hkv, d), ctx, 2)
        v = bh.shared_randn((s, hkv, d), ctx, 3)
        t1, t1_smp = None, bh.Sampler()
        if r == 0 and s <= 131072:
            with t1_smp:
                t1 = timed(lambda: partial_attention(q, k, v, causal=True, backend="cudnn"), reps=5, calls=3)
        plan = ShardPlan([0], [s], n, r)
        idx = plan.local_index().to(ctx.device)
        ql, kl, vl = q[idx], k[idx], v[idx]
        block = build_kv_block(plan, kl, vl)
        tiles0, tiles1 = plan.tiles(r, r), plan.tiles(r, (r - 1) % n)

        def kernels():
            for tiles in (tiles0, tiles1):
                for t in tiles:
                    partial_attention(ql[t.q0:t.q1], block[0][t.k0:t.k1], block[1][t.k0:t.k1], causal=t.causal)

        def with_merge():
            st = run_tiles(ql, block[0], block[1], tiles0, None)
            run_tiles(ql, block[0], block[1], tiles1, st)

        variants: dict[str, Callable[[], object]] = {"tiles": kernels, "tiles+merge": with_merge}
        if "copy_engine" in rings:
            src = torch.cat([kl.reshape(-1), vl.reshape(-1)]).view(torch.uint8)
            win = peer_window(ctx.group, src.numel(), ctx.device)
            # slot 1 of the next rank: a 2-rank ring only ever uses slot 0
            dsts = {"peer": win.slot((r + 1) % n, 1, src.numel()), "local": torch.empty_like(src)}
            side = torch.cuda.Stream(device=ctx.device)

            def with_copy(dst):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    dst.copy_(src)
                kernels()
                torch.cuda.current_stream().wait_stream(side)

            for where, dst in dsts.items():
                variants[f"tiles+copy[{where}]"] = lambda dst=dst: with_copy(dst)
        for name, ring in rings.items():
            variants[f"pass_kv[{name}]"] = lambda ring=ring: cp_prefill(ql, block, plan, ring, strategy="pass_kv")
        if "copy_engine" in rings:  # both settings of the second compute stream, whatever the default
            for label, rows in (("1 stream", 0), ("2 streams", 1 << 62)):
                def forced(rows=rows):
                    default, pass_kv.SECOND_STREAM_MAX_ROWS = pass_kv.SECOND_STREAM_MAX_ROWS, rows
                    try:
                        cp_prefill(ql, block, plan, rings["copy_engine"], strategy="pass_kv")
                    finally:
                        pass_kv.SECOND_STREAM_MAX_ROWS = default
                variants[f"pass_kv[copy_engine,{label}]"] = forced
        res, samples = timed_interleaved(variants)
        for i, tiles in enumerate((tiles0, tiles1)):
            for t in tiles:
                res[f"step{i} {'causal' if t.causal else 'dense'} {t.q1 - t.q0}x{t.k1 - t.k0}"] = timed(
                    lambda t=t: partial_attention(ql[t.q0:t.q1], block[0][t.k0:t.k1], block[1][t.k0:t.k1], causal=t.causal))
        st = run_tiles(ql, block[0], block[1], tiles0, None)
        o, l_ = run_tiles(ql, block[0], block[1], tiles1, None)
        rows = sum(t.q1 - t.q0 for t in tiles1)
        res[f"merge_into {rows} rows"] = timed(lambda: merge_into(st[0][:rows].clone(), st[1][:rows].clone(), o[:rows], l_[:rows]))
        res[f"  (clone of the inputs, subtract) {rows}"] = timed(lambda: (st[0][:rows].clone(), st[1][:rows].clone()))
        t1 = bh.all_max(ctx, [t1 or 0.0])[0]
        for rk in range(n):
            if rk == r:
                t1_clk = f", {t1_smp.clock:.0f} MHz {t1_smp.power:.0f} W" if t1_smp.clock else ""
                print(f"\n=== S={bh.size_label(s)} rank {r}  (single cuDNN T1 = {t1:.3f} ms on rank 0{t1_clk})", flush=True)
                for key, ms in res.items():
                    eff = t1 / (n * ms) if t1 and not key.startswith(("step", "merge", "  ")) else None
                    smp = samples.get(key)
                    clk = f"   {smp.clock:6.0f} MHz {smp.power:5.0f} W" if smp is not None and smp.clock else ""
                    print(f"  {key:36s} {ms:9.4f} ms" + (f"   eff {eff:.3f}" if eff else "") + clk, flush=True)
            torch.distributed.barrier()
        del q, k, v, ql, kl, vl, block
        bh.free(ctx)
    bh.finish(ctx)


if __name__ == "__main__":
    main()
