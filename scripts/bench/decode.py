#!/usr/bin/env python3
"""Decode attention (one query token per request): single GPU vs megacp all-gather decode on N GPUs,
eager and inside a CUDA graph, plus the all-gather alone (the communication part of the split).

Shape: 32 Q / 8 KV heads, head dim 128, bf16; batch 1 and 8; KV length 128K and 1M per request.

    torchrun --nproc_per_node 2 -m scripts.bench.decode --json out/decode.json [--check]

* single: ``partial_attention(q [B,1,Hq,D], k [B,L,Hkv,D], v, backend=B)`` for B in cuDNN, flash, on
  rank 0 alone (the others wait); the best is T1.
* megacp: each rank holds L/N tokens of every request, ``allgather_decode(q [B,Hq,D], (k_local, v_local),
  ParallelState.ring(), backend=B)``; eager, and captured once in a CUDA graph then replayed.
* all-gather alone: ``Ring.all_gather`` of the packed (out, LSE) states of the batch
  (``B·(Hq·D·2 + Hq·4)`` bytes per rank), eager and in a graph.

Times: ``ms`` = median of single calls, each after a barrier (max over ranks); ``loop_ms`` = per call
of back-to-back calls (no sync between them). ``vs_single`` = T_cp / T1 (ideal 1/N).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megacp.attention import allgather_decode, partial_attention
from megacp.parallel.ring import Ring
from scripts.bench import harness as bh


MERGES = {"auto": None, "torch": False, "fused": True}  # --merges name -> allgather_decode(fused_merge=)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    args = p.parse_args(argv)
    try:
        args.batch_list, args.length_list = bh.parse_sizes(args.batches), bh.parse_sizes(args.lengths)
    except ValueError as e:
        p.error(f"--batches / --lengths: {e}")
    args.merge_list = bh.parse_names(args.merges)
    if not args.merge_list or any(m not in MERGES for m in args.merge_list):
        p.error(f"--merges {args.merges!r}: choose from {', '.join(MERGES)}")
    return args


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


@dataclass
class Inputs:
    """One (batch, length) case: the replicated decode queries ``q [B, Hq, D]``, this rank's KV shard
    ``[B, L/N, Hkv, D]``, and (rank 0, ``--check``) the single-GPU reference with its noise."""

    b: int
    length: int
    q: torch.Tensor
    k_loc: torch.Tensor
    v_loc: torch.Tensor
    ref: torch.Tensor | None = None
    noise: float | None = None


@dataclass
class DecodeRun:
    """The rows, checks and failures of one decode benchmark run (every rank; rank 0 prints and writes)."""

    ctx: bh.Ctx
    args: argparse.Namespace
    rep: bh.Report
    timing: dict
    graphs: bool
    ring: Ring | None
    rows: list[dict] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)
    check_fail: bool = False

    def add(self, x: Inputs, method: str, tm: bh.Timing, loop_ms: float | None, note: str = "") -> None:
        row = {"batch": x.b, "kv_len": x.length, "kv_label": bh.size_label(x.length), "method": method, "ms": tm.ms,
               "min_ms": tm.min_ms, "max_ms": tm.max_ms, "iters": tm.iters, "loop_ms": loop_ms, "note": note,
               "times_ms": [round(t, 4) for t in tm.times_ms]}
        self.rows.append(row)
        self.rep.result(row)
        self.ctx.log(f"  {method:24s} {tm.ms * 1e3:10.1f} us   loop {bh.fmt(loop_ms and loop_ms * 1e3, '.1f'):>8s} us"
                     f"  ({tm.iters} iters) {note}")

    def compare(self, x: Inputs, method: str, out: torch.Tensor) -> None:
        """Rank 0: check a CP output ``[B, Hq, D]`` against the single-GPU reference."""
        if self.ctx.rank != 0 or x.ref is None:
            return
        st = bh.diff_stats(out, x.ref)
        tol = bh.tolerance(x.ref, x.noise, self.ctx.dtype)
        ok = st["max_abs"] == st["max_abs"] and st["max_abs"] <= tol
        self.check_fail |= not ok
        row = {"batch": x.b, "kv_len": x.length, "method": method, **st, "noise_max_abs": x.noise, "tol": tol, "ok": ok}
        self.checks.append(row)
        self.rep.check(row)
        print(f"  check {method:20s} max|err| {st['max_abs']:.3e} (noise {bh.fmt(x.noise, '.3e')}) "
              f"{'ok' if ok else 'MISMATCH'}", flush=True)

    def inputs(self, b: int, length: int) -> tuple[Inputs, tuple[torch.Tensor, torch.Tensor] | None]:
        a = self.args
        seed = a.seed + 1000 * b + length % 997
        q = bh.shared_randn((b, a.heads, a.head_dim), self.ctx, seed)
        (k_loc, v_loc), full = make_shards(self.ctx, b, length, a.kv_heads, a.head_dim, seed + 10)
        return Inputs(b, length, q, k_loc, v_loc), full

    def single(self, x: Inputs, full: tuple[torch.Tensor, torch.Tensor] | None, backends: list[str]) -> None:
        """Every single-GPU backend on rank 0 alone over the whole KV (the best is T1)."""
        ctx, a = self.ctx, self.args
        if ctx.rank == 0:
            kf, vf = full
            for be in backends:
                def fn(be: str = be):
                    return partial_attention(x.q.unsqueeze(1), kf, vf, backend=be)

                try:
                    tm = bh.measure(ctx, fn, collective=False, **self.timing)
                    self.add(x, f"single_{be}", tm, bh.measure_loop(ctx, fn, calls=a.loop_calls, collective=False),
                             "rank 0 alone")
                    if a.check:
                        out = fn()[0][:, 0]
                        if x.ref is None:
                            x.ref = out
                        else:
                            err = bh.diff_stats(out, x.ref)["max_abs"]
                            x.noise = err if x.noise is None else max(x.noise, err)
                except Exception as e:  # noqa: BLE001 - rank-local
                    self.rep.error(f"single_{be}", e, batch=x.b, kv_len=x.length)
        bh.free(ctx)
        bh.barrier(ctx)

    def megacp(self, x: Inputs, backends: list[str]) -> None:
        """``allgather_decode`` per local backend and merge, eager and (CUDA) replayed from a graph."""
        ctx, a = self.ctx, self.args
        for be, (mi, merge) in itertools.product(backends, enumerate(a.merge_list)):
            fused = MERGES[merge]
            tag = be if mi == 0 else f"{be}_{merge}"

            def fn(be: str = be, fused: bool | None = fused):
                return allgather_decode(x.q, (x.k_loc, x.v_loc), self.ring, backend=be, fused_merge=fused)

            try:
                tm = bh.measure(ctx, fn, **self.timing)
                self.add(x, f"megacp_{tag}_eager", tm, bh.measure_loop(ctx, fn, calls=a.loop_calls))
                eager_out = fn() if a.check else None
                if a.check:
                    self.compare(x, f"megacp_{tag}_eager", eager_out)
            except Exception as e:  # noqa: BLE001
                self.rep.error(f"megacp_{tag}_eager", e, batch=x.b, kv_len=x.length)
                continue
            if self.graphs:
                self._graph(x, f"megacp_{tag}_graph", fn, eager_out)
            bh.free(ctx)

    def _graph(self, x: Inputs, name: str, fn, eager_out: torch.Tensor | None) -> None:
        ctx, a = self.ctx, self.args
        try:
            g, static_out = bh.capture_graph(ctx, fn)
            tm = bh.measure(ctx, g.replay, **self.timing)
            self.add(x, name, tm, bh.measure_loop(ctx, g.replay, calls=a.loop_calls))
            if a.check:
                g.replay()
                bh.sync(ctx)
                self.compare(x, name, static_out)
                same = torch.equal(static_out, eager_out)
                ctx.log(f"  graph replay == eager output: {same}")
                if ctx.rank == 0:
                    self.checks[-1]["equal_to_eager"] = same
                    self.rep.check(dict(self.checks[-1], method=f"{name}_vs_eager", ok=same))
        except Exception as e:  # noqa: BLE001
            self.rep.error(name, e, batch=x.b, kv_len=x.length)

    def allgather(self, x: Inputs) -> None:
        """The all-gather alone: the packed (out, LSE) states of the batch, eager and in a graph."""
        if self.ring is None:
            return
        ctx, a = self.ctx, self.args
        nbytes = a.heads * a.head_dim * torch.empty((), dtype=ctx.dtype).element_size() + a.heads * 4
        buf = torch.zeros((x.b, nbytes), dtype=torch.uint8, device=ctx.device)

        def ag():
            return self.ring.all_gather(buf)

        try:
            note = f"{x.b * nbytes} B per rank"
            self.add(x, "allgather_eager", bh.measure(ctx, ag, **self.timing),
                     bh.measure_loop(ctx, ag, calls=a.loop_calls), note)
            if self.graphs:
                g, _ = bh.capture_graph(ctx, ag)
                self.add(x, "allgather_graph", bh.measure(ctx, g.replay, **self.timing),
                         bh.measure_loop(ctx, g.replay, calls=a.loop_calls), note)
        except Exception as e:  # noqa: BLE001
            self.rep.error("allgather", e, batch=x.b, kv_len=x.length)

    def ratios(self) -> None:
        """Rank 0: T1 of each case and ``vs_single`` = T_cp / T1 of every megacp row."""
        for b in self.args.batch_list:
            for length in self.args.length_list:
                sel = [x for x in self.rows if x["batch"] == b and x["kv_len"] == length]
                singles = [x["ms"] for x in sel if x["method"].startswith("single_")]
                t1 = min(singles) if singles else None
                for x in sel:
                    x["t1_ms"] = t1
                    x["vs_single"] = x["ms"] / t1 if t1 and x["method"].startswith("megacp") else None
                    x["us"] = x["ms"] * 1e3
                    x["loop_us"] = x["loop_ms"] * 1e3 if x["loop_ms"] is not None else None
        self.rep.save()

    def print_summary(self) -> None:
        ctx, a, n = self.ctx, self.args, self.ctx.world
        bh.print_table(ctx, self.rows, [("batch", "B", ""), ("kv_label", "L", ""), ("method", "method", ""),
                                        ("us", "us", ".1f"), ("loop_us", "loop us", ".1f"),
                                        ("vs_single", f"CP{n}/single", ".3f"), ("iters", "iters", ""), ("note", "note", "")],
                       title=f"Decode attention, H={a.heads}/{a.kv_heads} D={a.head_dim} "
                             f"{str(ctx.dtype).replace('torch.', '')}, CP={n} (ideal CP/single = {1 / n:.2f})")
        if a.check:
            bh.print_table(ctx, self.checks, [("batch", "B", ""), ("kv_len", "L", ""), ("method", "method", ""),
                                              ("max_abs", "max|err|", ".3e"), ("noise_max_abs", "noise", ".3e"),
                                              ("ok", "ok", "")],
                           title="CP decode output vs single GPU (noise = flash vs cuDNN)")
        self.rep.print_summary("decode", checked=a.check, failed=self.check_fail, where=("batch", "kv_len"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = bh.init(args.device, args.dtype)
    n = ctx.world
    bad = [x for x in args.length_list if x % n]
    if bad:
        ctx.log(f"error: --lengths {bad} must be multiples of N = {n}")
        bh.finish(ctx)
        return 2
    single_backends = bh.parse_names(args.single_backends or ("cudnn,flash" if ctx.cuda else "reference"))
    cp_backends = bh.parse_names(args.cp_backends or ("cudnn,flash" if ctx.cuda else "reference"))
    timing = dict(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters, target_s=args.target_s)
    meta = bh.env_info(ctx)
    meta.update(kind="decode", heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                batches=args.batch_list, lengths=args.length_list, cp_size=n, timing=timing,
                loop_calls=args.loop_calls, check=args.check)
    rep = bh.Report(ctx, args.json, meta)
    ctx.log(f"decode benchmark: {meta.get('gpu', 'cpu')} x{n}, torch {torch.__version__}, {ctx.dtype}, "
            f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, B={args.batch_list}, "
            f"L={[bh.size_label(x) for x in args.length_list]}")
    if not ctx.cuda:
        rep.skip("cuda_graph", "CUDA graphs need CUDA")
    elif args.no_graph:
        rep.skip("cuda_graph", "--no-graph")
    run = DecodeRun(ctx, args, rep, timing, ctx.cuda and not args.no_graph, ctx.state.ring())
    for b in args.batch_list:
        for length in args.length_list:
            ctx.log(f"\n=== B = {b}, L = {bh.size_label(length)} per request "
                    f"({b * length * args.kv_heads * args.head_dim * 2 * 2 / 2**30:.1f} GiB of KV, "
                    f"{length // n} tokens per rank) ===")
            x, full = run.inputs(b, length)
            run.single(x, full, single_backends)
            del full
            run.megacp(x, cp_backends)
            run.allgather(x)
            del x
            bh.free(ctx)
            bh.barrier(ctx)
    if ctx.rank == 0:
        run.ratios()
    run.print_summary()
    failed = not bh.agree(ctx, not run.check_fail)
    bh.finish(ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
