#!/usr/bin/env python3
"""Decode attention (one query token per request): single GPU vs megacp all-gather decode on N GPUs,
eager and inside a CUDA graph, plus the all-gather alone (the communication part of the split).

Shape: 32 Q / 8 KV heads, head dim 128, bf16; batch 1 and 8; KV length 128K and 1M per request.

    torchrun --nproc_per_node 2 -m scripts.bench.decode --json out/decode.json [--check]

* single: ``partial_attention(q [B,1,Hq,D], k [B,L,Hkv,D], v, backend=B)`` for B in cuDNN, flash, on
  rank 0 alone (the others wait); the best is T1.
* megacp: each rank holds L/N tokens of every request, ``allgather_decode(q [B,Hq,D], (k_local, v_local),
  Ring(group), backend=B)``; eager, and captured once in a CUDA graph then replayed.
* all-gather alone: ``Ring.all_gather`` of the packed (out, LSE) states of the batch
  (``B·(Hq·D·2 + Hq·4)`` bytes per rank), eager and in a graph.

Times: ``ms`` = median of single calls, each after a barrier (max over ranks); ``loop_ms`` = per call
of back-to-back calls (no sync between them). ``vs_single`` = T_cp / T1 (ideal 1/N).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.distributed as dist

from megacp.attention import allgather_decode, partial_attention
from megacp.parallel.ring import Ring
from scripts.bench import harness as bh


MERGES = {"auto": None, "torch": False, "fused": True}  # --merges name -> allgather_decode(fused_merge=)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bh.add_common_args(p)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--lengths", default="128K,1M", help="KV tokens per request (K/M suffixes)")
    p.add_argument("--single-backends", default=None, help="default cudnn,flash (reference on cpu)")
    p.add_argument("--cp-backends", default=None, help="local attention of the CP ranks; default cudnn,flash (reference on cpu)")
    p.add_argument("--merges", default="auto,torch",
                   help="merge after the all-gather: auto (the fused Triton kernel where it applies), torch; "
                        "rows megacp_<backend>_<eager|graph> for the first, ..._<merge> for the others")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph variants")
    p.add_argument("--check", action="store_true", help="compare the CP output (eager and graph) with the single-GPU output")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-iters", type=int, default=10)
    p.add_argument("--max-iters", type=int, default=100)
    p.add_argument("--target-s", type=float, default=0.4)
    p.add_argument("--loop-calls", type=int, default=20, help="calls of the back-to-back measurement")
    return p.parse_args(argv)


def make_shards(ctx: bh.Ctx, b: int, length: int, hkv: int, d: int, seed: int):
    """This rank's ``(k, v)`` ``[B, L/N, Hkv, D]`` (made on rank 0 and sent), and on rank 0 the
    full ``(K, V)`` ``[B, L, Hkv, D]`` = the shards concatenated in rank order (None elsewhere)."""
    n, per = ctx.world, length // ctx.world
    shape = (b, per, hkv, d)
    if ctx.rank == 0:
        ks, vs = [], []
        for j in range(n):
            ks.append(bh.randn(shape, ctx, seed + 2 * j))
            vs.append(bh.randn(shape, ctx, seed + 2 * j + 1))
            if j > 0:
                dist.send(ks[j], dst=j, group=ctx.group)
                dist.send(vs[j], dst=j, group=ctx.group)
        full_k, full_v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
        mine = (ks[0], vs[0])
        del ks, vs
        return mine, (full_k, full_v)
    k = torch.empty(shape, dtype=ctx.dtype, device=ctx.device)
    v = torch.empty(shape, dtype=ctx.dtype, device=ctx.device)
    dist.recv(k, src=0, group=ctx.group)
    dist.recv(v, src=0, group=ctx.group)
    return (k, v), None


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = bh.init(args.device, args.dtype)
    n = ctx.world
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    batches, lengths = bh.parse_sizes(args.batches), bh.parse_sizes(args.lengths)
    single_backends = bh.parse_names(args.single_backends or ("cudnn,flash" if ctx.cuda else "reference"))
    cp_backends = bh.parse_names(args.cp_backends or ("cudnn,flash" if ctx.cuda else "reference"))
    merges = bh.parse_names(args.merges)
    if not merges or any(m not in MERGES for m in merges):
        raise SystemExit(f"--merges {args.merges!r}: choose from {', '.join(MERGES)}")
    timing = dict(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters, target_s=args.target_s)
    meta = bh.env_info(ctx)
    meta.update(kind="decode", heads=h, kv_heads=hkv, head_dim=d, batches=batches, lengths=lengths, cp_size=n,
                timing=timing, loop_calls=args.loop_calls, check=args.check)
    rep = bh.Report(ctx, args.json, meta)
    ctx.log(f"decode benchmark: {meta.get('gpu', 'cpu')} x{n}, torch {torch.__version__}, {ctx.dtype}, H={h} Hkv={hkv} "
            f"D={d}, B={batches}, L={[bh.size_label(x) for x in lengths]}")
    graphs = ctx.cuda and not args.no_graph
    if not ctx.cuda:
        rep.skip("cuda_graph", "CUDA graphs need CUDA")
    elif args.no_graph:
        rep.skip("cuda_graph", "--no-graph")
    for length in lengths:
        if length % n:
            raise SystemExit(f"KV length {length} must be a multiple of N = {n}")
    ring = Ring(ctx.group) if n > 1 else None
    rows, checks = [], []
    check_fail = False

    def add(b, length, method, tm: bh.Timing, loop_ms: float | None, note: str = ""):
        row = {"batch": b, "kv_len": length, "kv_label": bh.size_label(length), "method": method, "ms": tm.ms,
               "min_ms": tm.min_ms, "max_ms": tm.max_ms, "iters": tm.iters, "loop_ms": loop_ms, "note": note,
               "times_ms": [round(t, 4) for t in tm.times_ms]}
        rows.append(row)
        rep.result(row)
        ctx.log(f"  {method:24s} {tm.ms * 1e3:10.1f} us   loop {bh.fmt(loop_ms and loop_ms * 1e3, '.1f'):>8s} us"
                f"  ({tm.iters} iters) {note}")

    for b in batches:
        for length in lengths:
            ctx.log(f"\n=== B = {b}, L = {bh.size_label(length)} per request "
                    f"({b * length * hkv * d * 2 * 2 / 2**30:.1f} GiB of KV, {length // n} tokens per rank) ===")
            seed = args.seed + 1000 * b + length % 997
            q = bh.shared_randn((b, h, d), ctx, seed)
            (k_loc, v_loc), full = make_shards(ctx, b, length, hkv, d, seed + 10)
            ref, noise = None, None

            # single GPU, rank 0 alone
            if ctx.rank == 0:
                kf, vf = full
                for be in single_backends:
                    def fn(be=be):
                        return partial_attention(q.unsqueeze(1), kf, vf, backend=be)

                    try:
                        tm = bh.measure(ctx, fn, collective=False, **timing)
                        add(b, length, f"single_{be}", tm, bh.measure_loop(ctx, fn, calls=args.loop_calls, collective=False),
                            "rank 0 alone")
                        if args.check:
                            out = fn()[0][:, 0]
                            if ref is None:
                                ref = out
                            else:
                                st = bh.diff_stats(out, ref)
                                noise = st["max_abs"] if noise is None else max(noise, st["max_abs"])
                    except Exception as e:  # noqa: BLE001 - rank-local
                        rep.error(f"single_{be}", e, batch=b, kv_len=length)
                del kf, vf
            full = None
            bh.free(ctx)
            bh.barrier(ctx)

            def compare(method, out):
                nonlocal check_fail
                if ctx.rank != 0 or ref is None:
                    return
                st = bh.diff_stats(out, ref)
                tol = bh.tolerance(ref, noise, ctx.dtype)
                ok = st["max_abs"] == st["max_abs"] and st["max_abs"] <= tol
                check_fail |= not ok
                row = {"batch": b, "kv_len": length, "method": method, **st, "noise_max_abs": noise, "tol": tol, "ok": ok}
                checks.append(row)
                rep.check(row)
                print(f"  check {method:20s} max|err| {st['max_abs']:.3e} (noise {bh.fmt(noise, '.3e')}) "
                      f"{'ok' if ok else 'MISMATCH'}", flush=True)

            # megacp all-gather decode
            for be, (mi, merge) in itertools.product(cp_backends, enumerate(merges)):
                fused = MERGES[merge]
                tag = be if mi == 0 else f"{be}_{merge}"

                def fn(be=be, fused=fused):
                    return allgather_decode(q, (k_loc, v_loc), ring, backend=be, fused_merge=fused)

                try:
                    tm = bh.measure(ctx, fn, **timing)
                    add(b, length, f"megacp_{tag}_eager", tm, bh.measure_loop(ctx, fn, calls=args.loop_calls))
                    eager_out = fn() if args.check else None
                    if args.check:
                        compare(f"megacp_{tag}_eager", eager_out)
                except Exception as e:  # noqa: BLE001
                    rep.error(f"megacp_{tag}_eager", e, batch=b, kv_len=length)
                    continue
                if graphs:
                    try:
                        g, static_out = bh.capture_graph(ctx, fn)
                        tm = bh.measure(ctx, g.replay, **timing)
                        add(b, length, f"megacp_{tag}_graph", tm, bh.measure_loop(ctx, g.replay, calls=args.loop_calls))
                        if args.check:
                            g.replay()
                            bh.sync(ctx)
                            compare(f"megacp_{tag}_graph", static_out)
                            same = torch.equal(static_out, eager_out)
                            ctx.log(f"  graph replay == eager output: {same}")
                            if ctx.rank == 0:
                                checks[-1]["equal_to_eager"] = same
                                rep.check(dict(checks[-1], method=f"megacp_{tag}_graph_vs_eager", ok=same))
                        del g, static_out
                    except Exception as e:  # noqa: BLE001
                        rep.error(f"megacp_{tag}_graph", e, batch=b, kv_len=length)
                del eager_out
                bh.free(ctx)

            # the all-gather alone (the packed states of the batch)
            if ring is not None:
                nbytes = h * d * torch.empty((), dtype=ctx.dtype).element_size() + h * 4
                buf = torch.zeros((b, nbytes), dtype=torch.uint8, device=ctx.device)

                def ag():
                    return ring.all_gather(buf)

                try:
                    note = f"{b * nbytes} B per rank"
                    add(b, length, "allgather_eager", bh.measure(ctx, ag, **timing),
                        bh.measure_loop(ctx, ag, calls=args.loop_calls), note)
                    if graphs:
                        g, _ = bh.capture_graph(ctx, ag)
                        add(b, length, "allgather_graph", bh.measure(ctx, g.replay, **timing),
                            bh.measure_loop(ctx, g.replay, calls=args.loop_calls), note)
                        del g
                except Exception as e:  # noqa: BLE001
                    rep.error("allgather", e, batch=b, kv_len=length)
            del q, k_loc, v_loc, ref
            bh.free(ctx)
            bh.barrier(ctx)

    if ctx.rank == 0:
        for b in batches:
            for length in lengths:
                sel = [x for x in rows if x["batch"] == b and x["kv_len"] == length]
                singles = [x["ms"] for x in sel if x["method"].startswith("single_")]
                t1 = min(singles) if singles else None
                for x in sel:
                    x["t1_ms"] = t1
                    x["vs_single"] = x["ms"] / t1 if t1 and x["method"].startswith("megacp") else None
                    x["us"] = x["ms"] * 1e3
                    x["loop_us"] = x["loop_ms"] * 1e3 if x["loop_ms"] is not None else None
        rep.save()
    bh.print_table(ctx, rows, [("batch", "B", ""), ("kv_label", "L", ""), ("method", "method", ""), ("us", "us", ".1f"),
                               ("loop_us", "loop us", ".1f"), ("vs_single", f"CP{n}/single", ".3f"),
                               ("iters", "iters", ""), ("note", "note", "")],
                   title=f"Decode attention, H={h}/{hkv} D={d} {str(ctx.dtype).replace('torch.', '')}, CP={n} "
                         f"(ideal CP/single = {1 / n:.2f})")
    if args.check:
        bh.print_table(ctx, checks, [("batch", "B", ""), ("kv_len", "L", ""), ("method", "method", ""),
                                     ("max_abs", "max|err|", ".3e"), ("noise_max_abs", "noise", ".3e"), ("ok", "ok", "")],
                       title="CP decode output vs single GPU (noise = flash vs cuDNN)")
    if ctx.rank == 0:
        for sk in rep.data["skipped"]:
            print(f"skipped: {sk['method']}: {sk['reason']}")
        for er in rep.data["errors"]:
            print(f"error: {er['method']} (B={er.get('batch')}, L={er.get('kv_len')}): {er['error'][:300]}")
        if args.json:
            print(f"JSON: {args.json}")
        print("decode check: " + ("FAIL" if check_fail else "ok" if args.check else "not run"), flush=True)
    failed = not bh.agree(ctx, not check_fail)
    bh.finish(ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
