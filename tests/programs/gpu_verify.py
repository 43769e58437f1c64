"""Exactness of megacp's CP attention on GPUs, in bf16 at 16K-128K tokens (N ranks, NCCL).

    torchrun --nproc_per_node 2 -m tests.programs.gpu_verify [--json out/verify.json]

Checks (each prints ``PASS``/``FAIL`` with its errors; the exit status is 1 when any fails):

1. prefill: ``cp_attention(q, k, v, group, strategy=pass_kv | pass_q)`` on whole sequences
   (``--seqlens``; plus one length that is not a multiple of 2N, and one run without load balancing)
   vs single-GPU ``partial_attention(q, k, v, causal=True)``;
2. ragged batch with cached prefixes: ``ShardPlan(cached, new, N, rank, prefix_counts=...)``,
   ``build_kv_block(..., cached=callable)`` and ``cp_prefill`` (both strategies) vs single-GPU
   attention of each request's new queries over its prefix + new keys;
3. decode: ``allgather_decode`` with ragged per-request KV (round-robin decode placement, a request
   that one rank holds no token of) and with equal lengths (one batched kernel call), eager and
   replayed from a CUDA graph, vs single-GPU attention.

Criteria (bf16 has no exact answer, so errors are judged against the kernels' own):
* every output finite;
* ``max|cp - single_cudnn| <= 4·noise + 2 ulp`` where noise = ``max|single_flash - single_cudnn|`` and
  ulp is bf16's unit in the last place at the output's largest magnitude (at least 1e-3);
* on sampled query rows (chunk edges + random), ``max|cp - exact| <= 3·max_k |kernel_k - exact| + floor``
  with ``exact`` computed in float64.
floor = 1e-3 (bf16/fp16); fp32 uses 1e-4 for both floors. On CPU (``--device cpu --dtype float32``) the kernels are the
reference path and the same checks run at small sizes.
"""

from __future__ import annotations

import argparse
import sys

import torch

from megacp.attention import (
    allgather_decode,
    build_kv_block,
    cp_attention,
    cp_prefill,
    partial_attention,
)
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan, positions_from_history
from scripts.bench import harness as bh


def parse_pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for tok in bh.parse_names(text):
        a, b = tok.split(":")
        out.append((bh.parse_sizes(a)[0], bh.parse_sizes(b)[0]))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bh.add_common_args(p)
    p.add_argument("--seqlens", default="16K,64K,128K", help="whole-sequence prefill lengths")
    p.add_argument("--odd-extra", type=int, default=5, help="also test seqlens[0] + this (0: skip)")
    p.add_argument("--ragged", default="8K:4K,0:12K,20000:1,30000:7001,5:9000",
                   help="ragged batch with cache: cached:new per request")
    p.add_argument("--decode", default="128K:5,65537:0,1:0,100000:33",
                   help="ragged decode: kv_len:decode_steps per request (steps = tokens placed round-robin)")
    p.add_argument("--decode-batched", default="4:64K", help="equal-length decode B:L (one kernel call per rank)")
    p.add_argument("--rows", type=int, default=96, help="query rows per check compared with the float64 answer")
    p.add_argument("--backends", default=None, help="single-GPU kernels, the first is the reference (default cudnn,flash)")
    return p.parse_args(argv)


class Verifier:
    def __init__(self, ctx: bh.Ctx, rep: bh.Report, backends: list[str]) -> None:
        self.ctx, self.rep, self.backends = ctx, rep, backends
        self.floor = 1e-4 if ctx.dtype == torch.float32 else 1e-3
        self.failed = 0
        self.passed = 0

    def judge(self, name: str, cp_out: torch.Tensor, kernel_outs: dict, rows: torch.Tensor | None,
              exact: torch.Tensor | None, **where) -> None:
        """Rank 0: compare ``cp_out`` with the kernels' outputs and with the exact rows."""
        if self.ctx.rank != 0:
            return
        ref_name = self.backends[0]
        ref = kernel_outs[ref_name]
        finite = bool(torch.isfinite(cp_out.float()).all())
        st = bh.diff_stats(cp_out, ref)
        noise = 0.0
        for be, out in kernel_outs.items():
            if be != ref_name:
                noise = max(noise, bh.diff_stats(out, ref)["max_abs"])
        tol_ref = bh.tolerance(ref, noise, self.ctx.dtype)
        ok = finite and st["max_abs"] <= tol_ref
        msg = f"max|cp-{ref_name}| {st['max_abs']:.3e} (tol {tol_ref:.3e}, noise {noise:.3e})"
        row = {"check": name, **where, "finite": finite, "max_abs_vs_ref": st["max_abs"],
               "mean_abs_vs_ref": st["mean_abs"], "noise": noise, "tol_vs_ref": tol_ref}
        if rows is not None and exact is not None:
            e_cp = (cp_out[rows].double() - exact).abs().max().item()
            e_k = max((o[rows].double() - exact).abs().max().item() for o in kernel_outs.values())
            tol_ex = 3 * e_k + self.floor
            ok = ok and e_cp <= tol_ex
            msg += f"; on {rows.numel()} rows vs float64: cp {e_cp:.3e}, kernels {e_k:.3e} (tol {tol_ex:.3e})"
            row.update(rows=int(rows.numel()), max_abs_vs_exact=e_cp, kernels_vs_exact=e_k, tol_vs_exact=tol_ex)
        row["ok"] = ok
        self.rep.check(row)
        where_s = " ".join(f"{k}={v}" for k, v in where.items())
        print(f"{'PASS' if ok else 'FAIL'} {name} {where_s}: {msg}" + ("" if finite else " NON-FINITE"), flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed += 1

    def kernels(self, fn) -> dict:
        """``{backend: fn(backend)}`` for every single-GPU backend (rank 0)."""
        return {be: fn(be) for be in self.backends}

    def error(self, name: str, exc: BaseException, **where) -> None:
        self.rep.error(name, exc, **where)
        if self.ctx.rank == 0:
            print(f"FAIL {name} {where}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        self.failed += 1


def gather_plan(ctx: bh.Ctx, plan: ShardPlan, out_local: torch.Tensor) -> torch.Tensor:
    idx = [plan.local_index(j) for j in range(ctx.world)]
    return bh.gather_rows(ctx, out_local, idx, sum(plan.new))


def check_prefill(ctx, ver: Verifier, args, s: int, strategies, *, load_balance: bool = True) -> None:
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    q = bh.shared_randn((s, h, d), ctx, args.seed + s + 1)
    k = bh.shared_randn((s, hkv, d), ctx, args.seed + s + 2)
    v = bh.shared_randn((s, hkv, d), ctx, args.seed + s + 3)
    outs = {}
    for strat in strategies:
        try:
            outs[strat] = cp_attention(q, k, v, ctx.group, strategy=strat, load_balance=load_balance)
        except Exception as e:  # noqa: BLE001
            ver.error(f"prefill_{strat}", e, S=s)
    bh.barrier(ctx)
    if ctx.rank == 0 and outs:
        kern = ver.kernels(lambda be: partial_attention(q, k, v, causal=True, backend=be)[0])  # noqa: F821  # called at once
        c = -(-s // (2 * ctx.world))
        rows = bh.sample_rows(s, args.rows, args.seed + s, edges=[c * i for i in range(1, 2 * ctx.world)])
        exact = bh.truth_rows(q, k, v, rows, causal=True)
        for strat, out in outs.items():
            ver.judge(f"prefill_{strat}", out, kern, rows, exact, S=s, load_balance=load_balance)
    del q, k, v, outs
    bh.free(ctx)
    bh.barrier(ctx)


def check_ragged(ctx, ver: Verifier, args, spec: list[tuple[int, int]], strategies) -> None:
    """Ragged batch with cached prefixes, each prefix sharded as one earlier prefill step would have."""
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    n, r = ctx.world, ctx.rank
    cached = [p for p, _ in spec]
    new = [t for _, t in spec]
    # full keys/values of each request (prefix + new), queries of the new tokens; identical on every rank
    ks = [bh.shared_randn((p + t, hkv, d), ctx, args.seed + 100 + 3 * i) for i, (p, t) in enumerate(spec)]
    vs = [bh.shared_randn((p + t, hkv, d), ctx, args.seed + 101 + 3 * i) for i, (p, t) in enumerate(spec)]
    qs = [bh.shared_randn((t, h, d), ctx, args.seed + 102 + 3 * i) for i, (p, t) in enumerate(spec)]
    # cache bookkeeping: request i's prefix came from one prefill step [0, P_i]
    prefix_pos = [[positions_from_history([0, p], n, j) if p else [] for p in cached] for j in range(n)]
    prefix_counts = [[len(x) for x in row] for row in prefix_pos]
    plan = ShardPlan(cached, new, n, r, prefix_counts=prefix_counts)
    q_new = torch.cat(qs)
    k_new = torch.cat([kf[p:] for kf, p in zip(ks, cached)])
    v_new = torch.cat([vf[p:] for vf, p in zip(vs, cached)])
    my = plan.local_index().to(ctx.device)
    ql, kl, vl = q_new[my], k_new[my], v_new[my]

    def cache(i: int):
        pos = torch.tensor(prefix_pos[r][i], dtype=torch.long, device=ctx.device)
        return ks[i][pos], vs[i][pos]

    ring = Ring(ctx.group) if n > 1 else None
    outs = {}
    try:
        kv_block = build_kv_block(plan, kl, vl, cached=cache)
        for strat in strategies:
            try:
                outs[strat] = gather_plan(ctx, plan, cp_prefill(ql, kv_block, plan, ring, strategy=strat))
            except Exception as e:  # noqa: BLE001
                ver.error(f"ragged_{strat}", e)
    except Exception as e:  # noqa: BLE001
        ver.error("ragged_build_kv_block", e)
    bh.barrier(ctx)
    if ctx.rank == 0 and outs:
        kern = ver.kernels(lambda be: torch.cat([partial_attention(qi, kf, vf, causal=True, backend=be)[0]
                                                 for qi, kf, vf in zip(qs, ks, vs)]))
        rows_all, exact_all, off = [], [], 0
        per = max(4, args.rows // len(spec))
        for i, (_, t) in enumerate(spec):
            rws = bh.sample_rows(t, per, args.seed + i)
            exact_all.append(bh.truth_rows(qs[i], ks[i], vs[i], rws, causal=True))
            rows_all.append(rws + off)
            off += t
        rows, exact = torch.cat(rows_all), torch.cat(exact_all)
        desc = ",".join(f"{p}+{t}" for p, t in spec)
        for strat, out in outs.items():
            ver.judge(f"ragged_cached_{strat}", out, kern, rows, exact, requests=desc)
    bh.free(ctx)
    bh.barrier(ctx)


def check_decode_ragged(ctx, ver: Verifier, args, spec: list[tuple[int, int]]) -> None:
    """Ragged: request i has L_i tokens: a prefill of L_i - steps_i tokens, then steps_i decoded
    tokens placed round-robin; a request of one token leaves the other ranks without any."""
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    n, r = ctx.world, ctx.rank
    ring = Ring(ctx.group) if n > 1 else None
    b = len(spec)
    q = bh.shared_randn((b, h, d), ctx, args.seed + 300)
    ks = [bh.shared_randn((length, hkv, d), ctx, args.seed + 301 + 2 * i) for i, (length, _) in enumerate(spec)]
    vs = [bh.shared_randn((length, hkv, d), ctx, args.seed + 302 + 2 * i) for i, (length, _) in enumerate(spec)]
    local = []
    for i, (length, steps) in enumerate(spec):
        hist = [0, length - steps] + [length - steps + j for j in range(1, steps + 1)] if length - steps > 0 else \
            list(range(0, length + 1))
        pos = torch.tensor(positions_from_history(hist, n, r), dtype=torch.long, device=ctx.device)
        local.append((ks[i][pos], vs[i][pos]))
    out = None
    try:
        out = allgather_decode(q, local, ring)
    except Exception as e:  # noqa: BLE001
        ver.error("decode_ragged", e)
    bh.barrier(ctx)
    if ctx.rank == 0 and out is not None:
        kern = ver.kernels(lambda be: torch.cat([partial_attention(q[i:i + 1], ks[i], vs[i], backend=be)[0]  # noqa: F821
                                                 for i in range(b)]))
        exact = torch.cat([bh.truth_rows(q[i:i + 1], ks[i], vs[i], torch.tensor([0]), causal=False) for i in range(b)])
        desc = ",".join(f"{length}({steps} decoded)" for length, steps in spec)
        ver.judge("decode_ragged", out, kern, torch.arange(b), exact, requests=desc)
    del ks, vs, local
    bh.free(ctx)
    bh.barrier(ctx)


def check_decode_batched(ctx, ver: Verifier, args, batched: tuple[int, int]) -> None:
    """Equal lengths: one batched kernel call per rank; eager and replayed from a CUDA graph."""
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    n, r = ctx.world, ctx.rank
    ring = Ring(ctx.group) if n > 1 else None
    bb, length = batched
    q = bh.shared_randn((bb, h, d), ctx, args.seed + 400)
    kf = bh.shared_randn((bb, length, hkv, d), ctx, args.seed + 401)
    vf = bh.shared_randn((bb, length, hkv, d), ctx, args.seed + 402)
    per = length // n
    sl = slice(r * per, (r + 1) * per if r < n - 1 else length)
    kl, vl = kf[:, sl].contiguous(), vf[:, sl].contiguous()

    def fn():
        return allgather_decode(q, (kl, vl), ring)

    outs = {}
    try:
        outs["eager"] = fn()
        if ctx.cuda:
            g, static = bh.capture_graph(ctx, fn)
            g.replay()
            bh.sync(ctx)
            outs["graph"] = static.clone()
            same = bool(torch.equal(outs["graph"], outs["eager"]))
            if ctx.rank == 0:
                print(f"{'PASS' if same else 'NOTE'} decode_graph_replay_equals_eager B={bb} L={length}: {same}", flush=True)
                ver.rep.check({"check": "decode_graph_vs_eager", "B": bb, "L": length, "ok": same})
    except Exception as e:  # noqa: BLE001
        ver.error("decode_batched", e, B=bb, L=length)
    bh.barrier(ctx)
    if ctx.rank == 0 and outs:
        kern = ver.kernels(lambda be: partial_attention(q.unsqueeze(1), kf, vf, backend=be)[0][:, 0])
        exact = torch.cat([bh.truth_rows(q[i:i + 1], kf[i], vf[i], torch.tensor([0]), causal=False) for i in range(bb)])
        for mode, o in outs.items():
            ver.judge(f"decode_batched_{mode}", o, kern, torch.arange(bb), exact, B=bb, L=length)
    bh.free(ctx)
    bh.barrier(ctx)


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = bh.init(args.device, args.dtype)
    backends = bh.parse_names(args.backends or ("cudnn,flash" if ctx.cuda else "reference"))
    meta = bh.env_info(ctx)
    meta.update(kind="verify", heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, backends=backends)
    rep = bh.Report(ctx, args.json, meta)
    ver = Verifier(ctx, rep, backends)
    ctx.log(f"gpu_verify: {meta.get('gpu', 'cpu')} x{ctx.world}, torch {torch.__version__}, {ctx.dtype}, "
            f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, kernels {backends}")
    strategies = ("pass_kv", "pass_q")
    seqlens = bh.parse_sizes(args.seqlens)
    for s in seqlens:
        check_prefill(ctx, ver, args, s, strategies)
    if seqlens and args.odd_extra:
        check_prefill(ctx, ver, args, seqlens[0] + args.odd_extra, strategies)
    if seqlens:
        check_prefill(ctx, ver, args, seqlens[0], ("pass_kv",), load_balance=False)
    if args.ragged:
        check_ragged(ctx, ver, args, parse_pairs(args.ragged), strategies)
    if args.decode:
        check_decode_ragged(ctx, ver, args, parse_pairs(args.decode))
    if args.decode_batched:
        check_decode_batched(ctx, ver, args, parse_pairs(args.decode_batched)[0])
    failed = not bh.agree(ctx, ver.failed == 0)
    if ctx.rank == 0:
        print(f"{ver.passed} passed, {ver.failed} failed", flush=True)
    bh.finish(ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
