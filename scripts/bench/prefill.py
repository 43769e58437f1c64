"""Causal prefill attention: best single GPU vs megacp pass-KV / pass-Q vs the CP of PyTorch,
Transformer Engine and DeepSpeed-Ulysses, all measured in one run.

Shape: Llama-3-8B attention (32 Q / 8 KV heads, head dim 128), bf16, causal, batch 1.

    torchrun --nproc_per_node 2 -m scripts.bench.prefill --json out/prefill.json [--check]

Methods (``--methods``, comma list of families):

* ``single``  — ``megacp.attention.partial_attention(q, k, v, causal=True, backend=B)`` for B in
  ``--single-backends`` (cuDNN, flash) on the whole sequence, on rank 0 alone; the best is T1.
  Then every other rank times the first backend alone too (row ``single_<B>@rank<j>``, a
  diagnostic, never T1): two GPUs of one machine differ by a few percent on identical work, and
  the CP time is the slower rank's.
* ``megacp``  — ``ShardPlan([0], [S], N, rank)`` (2N-chunk load balancing), then, timed together,
  ``build_kv_block`` (the local K and V themselves: nothing is copied) and
  ``cp_prefill(..., strategy="pass_kv" | "pass_q")``.
* ``torch``   — ``torch.distributed.tensor.experimental.context_parallel`` (DeviceMesh of the ranks,
  head-tail load balancing) around ``F.scaled_dot_product_attention(is_causal=True)`` under
  ``sdpa_kernel`` (cuDNN / flash) and ``set_rotate_method`` (allgather / alltoall). GQA is passed
  natively (``enable_gqa=True``) when a small probe shows torch's CP computes it right; otherwise
  the KV heads are repeated and the output says so.
* ``te``      — ``te.DotProductAttention(H, D, num_gqa_groups=Hkv, attn_mask_type="causal",
  qkv_format="bshd")`` with ``set_context_parallel_group(group, ranks, stream, comm)`` for comm in
  ``--te-comm`` (p2p, all_gather, a2a); inputs in the 2N-chunk load-balanced layout.
* ``ds``      — ``deepspeed.sequence.layer.DistributedAttention(local_attn, group)`` (Ulysses: heads
  scattered, sequence gathered; contiguous sequence shards, seq-first layout) with a local attention
  that is torch SDPA on cuDNN with GQA.

Efficiency of a CP method = T1 / (N · T_cp); TFLOP/s per GPU = causal FLOPs (2·S²·H·D) / N / T.
Every call is timed alone (barrier before it), so it pays the host-side launch of its first kernel;
``--loop K`` also times K calls back to back (``loop ms``, ``loop eff`` against the single GPU's
loop time), where the host queues ahead as it does between the layers of a model.
``--check`` also gathers every method's output and compares it with the single-GPU cuDNN output,
next to the flash-vs-cuDNN difference (the bf16 noise floor). Peers that cannot run print
``skipped: <reason>``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megacp.attention import build_kv_block, cp_prefill, partial_attention
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan
from scripts.bench import harness as bh
from scripts.bench.harness.peers import Peers, setup_peers

FAMILIES = ("single", "megacp", "torch", "te", "ds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bh.add_common_args(p)
    p.add_argument("--seqlens", default="16384,65536,131072,262144", help="comma list (16K, 1M suffixes allowed)")
    p.add_argument("--methods", default=",".join(FAMILIES), help=f"families to run, from {','.join(FAMILIES)}")
    p.add_argument("--single-backends", default=None, help="default cudnn,flash (reference on cpu)")
    p.add_argument("--megacp-backend", default=None, help="partial-attention backend of megacp (default: auto)")
    p.add_argument("--strategies", default="pass_kv,pass_q")
    p.add_argument("--transports", default="auto,nccl",
                   help="ring transports of megacp (auto, nccl, copy_engine; nccl_hp = NCCL on a group created "
                        "with a high-priority stream); rows are megacp_<strategy> for the first, "
                        "megacp_<strategy>[<transport>] for the others")
    p.add_argument("--torch-backends", default="cudnn,flash")
    p.add_argument("--torch-rotate", default="allgather,alltoall")
    p.add_argument("--te-comm", default="p2p,all_gather,a2a")
    p.add_argument("--check", action="store_true", help="compare every method's output with the single-GPU output")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=20)
    p.add_argument("--target-s", type=float, default=1.5, help="timed seconds per measurement (bounds the calls)")
    p.add_argument("--loop", type=int, default=0,
                   help="also time this many calls back to back (no barrier between them; at most as many as the "
                        "timed isolated calls): the loop_ms column and its efficiency against single-GPU loop time")
    args = p.parse_args(argv)
    try:
        args.seqlen_list = bh.parse_sizes(args.seqlens)
    except ValueError as e:
        p.error(f"--seqlens: {e}")
    args.families = bh.parse_names(args.methods)
    bad = [f for f in args.families if f not in FAMILIES]
    if bad:
        p.error(f"unknown --methods {bad}; choose from {', '.join(FAMILIES)}")
    if "nccl_hp" in bh.parse_names(args.transports) and args.device != "cuda":
        p.error("--transports nccl_hp needs NCCL (--device cuda)")
    return args


def make_rings(ctx: bh.Ctx, transports: list[str]) -> dict[str, Ring | None]:
    """One megacp ring per transport name (``None`` on a world of one)."""
    rings: dict[str, Ring | None] = {}
    for tr in transports:
        if ctx.world == 1:
            rings[tr] = None
        elif tr == "nccl_hp":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = True
            rings[tr] = Ring(dist.new_group(list(range(ctx.world)), pg_options=opts), transport="nccl")
        else:
            rings[tr] = Ring(ctx.group, transport=tr)
        ctx.log(f"megacp ring transport {tr}: {rings[tr].transport if rings[tr] else '-'}")
    return rings


@dataclass
class Inputs:
    """One sequence length's data: whole q ``[S, H, D]``, k/v ``[S, Hkv, D]`` on every rank, this
    rank's load-balanced shard of them, the plan, and (rank 0, ``--check``) the reference output
    with the flash-vs-cuDNN noise."""

    s: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    plan: ShardPlan
    idx: list[torch.Tensor]
    ql: torch.Tensor
    kl: torch.Tensor
    vl: torch.Tensor
    ref: torch.Tensor | None = None
    noise: float | None = None


def make_inputs(ctx: bh.Ctx, args: argparse.Namespace, s: int) -> Inputs:
    n, r = ctx.world, ctx.rank
    q = bh.shared_randn((s, args.heads, args.head_dim), ctx, args.seed + 1)
    k = bh.shared_randn((s, args.kv_heads, args.head_dim), ctx, args.seed + 2)
    v = bh.shared_randn((s, args.kv_heads, args.head_dim), ctx, args.seed + 3)
    plan = ShardPlan([0], [s], n, r)
    idx = [plan.local_index(j) for j in range(n)]
    if not all(torch.equal(idx[j], bh.load_balanced_index(s, n, j)) for j in range(n)):
        raise RuntimeError("megacp's load-balanced layout differs from the 2N-chunk layout TE expects")
    my = idx[r].to(ctx.device)
    return Inputs(s, q, k, v, plan, idx, q[my], k[my], v[my])


@dataclass
class PrefillRun:
    """The rows, checks and failures of one benchmark run (every rank; rank 0 prints and writes)."""

    ctx: bh.Ctx
    args: argparse.Namespace
    rep: bh.Report
    timing: dict
    single_backends: list[str]
    rows: list[dict] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)
    megacp_fail: bool = False

    def add(self, s: int, method: str, tm: bh.Timing, per_gpu_div: int, note: str = "") -> dict:
        """Record one timed method; TFLOP/s per GPU = causal FLOPs / ``per_gpu_div`` / time."""
        a = self.args
        tf = bh.attn_flops(s, a.heads, a.head_dim) / per_gpu_div / (tm.ms * 1e-3) / 1e12
        row = {"seqlen": s, "method": method, "ms": tm.ms, "min_ms": tm.min_ms, "max_ms": tm.max_ms, "iters": tm.iters,
               "tflops_per_gpu": tf, "note": note, "times_ms": [round(t, 4) for t in tm.times_ms], "loop_ms": tm.loop_ms}
        self.rows.append(row)
        self.rep.result(row)
        self.ctx.log(f"  {method:28s} {tm.ms:10.3f} ms  {bh.fmt(tf, '7.1f'):>7s} TFLOP/s/GPU  ({tm.iters} iters) {note}")
        return row

    def compare(self, x: Inputs, method: str, full: torch.Tensor | None) -> None:
        """Rank 0: check a method's whole output ``[S, H, D]`` against the single-GPU reference."""
        if self.ctx.rank != 0 or x.ref is None or full is None:
            return
        st = bh.diff_stats(full, x.ref)
        ratio = st["max_abs"] / x.noise if x.noise else None
        tol = bh.tolerance(x.ref, x.noise, self.ctx.dtype)
        ok = st["max_abs"] == st["max_abs"] and st["max_abs"] <= tol
        row = {"seqlen": x.s, "method": method, **st, "ref": f"single_{self.single_backends[0]}",
               "noise_max_abs": x.noise, "ratio_to_noise": ratio, "tol": tol, "ok": ok}
        self.checks.append(row)
        self.rep.check(row)
        print(f"  check {method:22s} max|err| {st['max_abs']:.3e} mean {st['mean_abs']:.3e}"
              f" (noise {bh.fmt(x.noise, '.3e')}, x{bh.fmt(ratio, '.2f')}) {'ok' if ok else 'MISMATCH'}", flush=True)
        if method.startswith("megacp") and not ok:
            self.megacp_fail = True

    def single(self, x: Inputs) -> None:
        """Every single-GPU backend on rank 0 alone (the best is T1), then the first backend on
        every other GPU, one at a time (diagnostic rows)."""
        ctx, first = self.ctx, self.single_backends[0]
        if ctx.rank == 0:
            for be in self.single_backends:
                try:
                    def fn(be: str = be):
                        return partial_attention(x.q, x.k, x.v, causal=True, backend=be)

                    self.add(x.s, f"single_{be}", bh.measure(ctx, fn, collective=False, **self.timing), 1, "rank 0 alone")
                    if self.args.check:
                        self._reference(x, be, fn()[0])
                except Exception as e:  # noqa: BLE001 - rank-local, the others wait at the barrier
                    self.rep.error(f"single_{be}", e, seqlen=x.s)
            bh.free(ctx)
        bh.barrier(ctx)
        for j in range(1, ctx.world):
            tm = None
            if ctx.rank == j:
                tm = bh.measure(ctx, lambda: partial_attention(x.q, x.k, x.v, causal=True, backend=first),
                                collective=False, **self.timing)
                bh.free(ctx)
            tm = bh.bcast_obj(ctx, tm, src=j)
            if ctx.rank == 0:
                self.add(x.s, f"single_{first}@rank{j}", tm, 1, f"rank {j} alone (diagnostic, not T1)")["diagnostic"] = True
            bh.barrier(ctx)

    def _reference(self, x: Inputs, be: str, out: torch.Tensor) -> None:
        """The first backend's output is the reference; the others widen the noise."""
        if x.ref is None:
            x.ref = out
            return
        st = bh.diff_stats(out, x.ref)
        x.noise = st["max_abs"] if x.noise is None else max(x.noise, st["max_abs"])
        print(f"  noise single_{be} vs single_{self.single_backends[0]}: max|err| {st['max_abs']:.3e}"
              f" mean {st['mean_abs']:.3e}", flush=True)

    def megacp(self, x: Inputs, rings: dict[str, Ring | None]) -> None:
        """``build_kv_block`` + ``cp_prefill`` for every strategy and transport, timed together."""
        ctx, n = self.ctx, self.ctx.world
        for strat in bh.parse_names(self.args.strategies):
            for ti, (tr, ring) in enumerate(rings.items()):
                name = f"megacp_{strat}" if ti == 0 else f"megacp_{strat}[{tr}]"
                try:
                    def fn(strat: str = strat, ring: Ring | None = ring):
                        kv_block = build_kv_block(x.plan, x.kl, x.vl)  # (kl, vl) themselves: no copy
                        return cp_prefill(x.ql, kv_block, x.plan, ring, strategy=strat, backend=self.args.megacp_backend)

                    self.add(x.s, name, bh.measure(ctx, fn, **self.timing), n, f"transport {ring.transport if ring else '-'}")
                    if self.args.check:
                        self.compare(x, name, bh.gather_rows(ctx, fn(), x.idx, x.s))
                except Exception as e:  # noqa: BLE001
                    self.rep.error(name, e, seqlen=x.s)
        bh.free(ctx)
        bh.barrier(ctx)

    def torch_cp(self, x: Inputs, peers: Peers) -> None:
        """PyTorch CP for every SDPA backend and rotate method."""
        tcp, a = peers.torch_cp, self.args
        if tcp.reason:
            if x.s == a.seqlen_list[0]:
                self.rep.skip("torch_cp", tcp.reason)
            return
        for be in bh.parse_names(a.torch_backends):
            for rot in bh.parse_names(a.torch_rotate):
                name = f"torch_cp_{be}_{rot}"
                gqa = tcp.gqa.get(be, False)
                try:
                    tm, full = tcp.run(x.q, x.k, x.v, be, rot, gqa, self.timing, a.check)
                    self.add(x.s, name, tm, self.ctx.world, "enable_gqa" if gqa else f"KV repeated {a.heads // a.kv_heads}x")
                    self.compare(x, name, full)
                    del full
                except Exception as e:  # noqa: BLE001
                    self.rep.error(name, e, seqlen=x.s)
                bh.free(self.ctx)
                bh.barrier(self.ctx)

    def te(self, x: Inputs, peers: Peers) -> None:
        """Transformer Engine CP for every ``--te-comm`` type, on the load-balanced shards."""
        te, a = peers.te, self.args
        if te.reason:
            if x.s == a.seqlen_list[0]:
                self.rep.skip("te", te.reason)
            return
        qb, kb, vb = x.ql.unsqueeze(0), x.kl.unsqueeze(0), x.vl.unsqueeze(0)  # [1, S/N, H, D], 2N-chunk layout
        for comm in bh.parse_names(a.te_comm):
            name = f"te_{comm}"
            try:
                dpa = te.module(a.heads, a.kv_heads, a.head_dim, comm)
                with torch.no_grad():
                    def fn(dpa: torch.nn.Module = dpa):
                        return dpa(qb, kb, vb)

                    self.add(x.s, name, bh.measure(self.ctx, fn, **self.timing), self.ctx.world, f"TE {te.version}")
                    if a.check:
                        self.compare(x, name, bh.gather_rows(self.ctx, fn().reshape(-1, a.heads, a.head_dim), x.idx, x.s))
                del dpa
            except Exception as e:  # noqa: BLE001
                self.rep.error(name, e, seqlen=x.s)
            bh.free(self.ctx)
            bh.barrier(self.ctx)

    def ulysses(self, x: Inputs, peers: Peers) -> None:
        """DeepSpeed-Ulysses on contiguous shards (heads must divide by N)."""
        ds, a, ctx = peers.ulysses, self.args, self.ctx
        n, r = ctx.world, ctx.rank
        reason = ds.reason
        if reason is None and (a.heads % n or a.kv_heads % n):
            reason = f"Ulysses needs heads divisible by N ({a.heads}, {a.kv_heads}, N={n})"
        if reason:
            if x.s == a.seqlen_list[0]:
                self.rep.skip("ds_ulysses", reason)
            return
        cidx = [bh.contiguous_index(x.s, n, j) for j in range(n)]
        sl = slice(r * (x.s // n), (r + 1) * (x.s // n))
        qs, ks, vs = x.q[sl].unsqueeze(1), x.k[sl].unsqueeze(1), x.v[sl].unsqueeze(1)  # [S/N, 1, H, D]
        try:
            mod = ds.module()
            with torch.no_grad():
                def fn(mod: torch.nn.Module = mod):
                    return ds.call(mod, qs, ks, vs)

                self.add(x.s, "ds_ulysses_cudnn", bh.measure(ctx, fn, **self.timing), n, f"DeepSpeed {ds.version}")
                if a.check:
                    self.compare(x, "ds_ulysses_cudnn", bh.gather_rows(ctx, fn().reshape(-1, a.heads, a.head_dim), cidx, x.s))
        except Exception as e:  # noqa: BLE001
            self.rep.error("ds_ulysses_cudnn", e, seqlen=x.s)
        bh.free(ctx)
        bh.barrier(ctx)

    def efficiencies(self) -> None:
        """Rank 0: T1 (best single GPU, diagnostics excluded) and T1 / (N · T) of every CP row."""
        n = self.ctx.world
        for s in self.args.seqlen_list:
            singles = [x for x in self.rows if x["seqlen"] == s and x["method"].startswith("single_")
                       and not x.get("diagnostic")]
            t1 = min((x["ms"] for x in singles), default=None)
            t1_loop = min((x["loop_ms"] for x in singles if x.get("loop_ms")), default=None)
            for x in self.rows:
                if x["seqlen"] != s:
                    continue
                x["seqlen_label"] = bh.size_label(s)
                x["efficiency"] = x["loop_efficiency"] = None
                if t1 and not x["method"].startswith("single_"):
                    x["efficiency"] = t1 / (n * x["ms"])
                    if t1_loop and x.get("loop_ms"):
                        x["loop_efficiency"] = t1_loop / (n * x["loop_ms"])
                if t1:
                    x["t1_ms"] = t1
        self.rep.save()

    def print_summary(self) -> None:
        ctx, a, n = self.ctx, self.args, self.ctx.world
        loop_cols = [("loop_ms", "loop ms", ".3f"), ("loop_efficiency", "loop eff", ".3f")] if a.loop else []
        bh.print_table(ctx, self.rows, [("seqlen_label", "seqlen", ""), ("method", "method", ""), ("ms", "ms", ".3f"),
                                        ("tflops_per_gpu", "TFLOP/s/GPU", ".1f"), ("efficiency", f"eff T1/({n}T)", ".3f"),
                                        *loop_cols, ("iters", "iters", ""), ("note", "note", "")],
                       title=f"Causal prefill, H={a.heads}/{a.kv_heads} D={a.head_dim} "
                             f"{str(ctx.dtype).replace('torch.', '')}, CP={n}")
        if a.check:
            bh.print_table(ctx, self.checks, [("seqlen", "seqlen", ""), ("method", "method", ""),
                                              ("max_abs", "max|err|", ".3e"), ("mean_abs", "mean|err|", ".3e"),
                                              ("noise_max_abs", "noise", ".3e"), ("ratio_to_noise", "x noise", ".2f"),
                                              ("ok", "ok", "")],
                           title="Outputs vs single-GPU (noise = flash vs cuDNN on one GPU)")
        self.rep.print_summary("megacp", checked=a.check, failed=self.megacp_fail, where=("seqlen",))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = bh.init(args.device, args.dtype)
    n = ctx.world
    bad = [s for s in args.seqlen_list if s % (2 * n)]
    if bad:
        ctx.log(f"error: --seqlens {bad} must be multiples of 2N = {2 * n}")
        bh.finish(ctx)
        return 2
    timing = dict(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters, target_s=args.target_s,
                  loop_calls=args.loop)
    meta = bh.env_info(ctx)
    meta.update(kind="prefill", heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, batch=1, causal=True,
                seqlens=args.seqlen_list, cp_size=n, families=args.families, timing=timing, check=args.check)
    rep = bh.Report(ctx, args.json, meta)
    ctx.log(f"prefill benchmark: {meta.get('gpu', 'cpu')} x{n}, torch {torch.__version__}, {ctx.dtype}, "
            f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim}, "
            f"S={','.join(map(bh.size_label, args.seqlen_list))}, families={args.families}")
    single_backends = bh.parse_names(args.single_backends or ("cudnn,flash" if ctx.cuda else "reference"))
    run = PrefillRun(ctx, args, rep, timing, single_backends)
    peers = setup_peers(ctx, args.families, args, rep.note)
    rings = make_rings(ctx, bh.parse_names(args.transports)) if "megacp" in args.families else {}
    for s in args.seqlen_list:
        ctx.log(f"\n=== S = {bh.size_label(s)} ({s}) ===")
        x = make_inputs(ctx, args, s)
        if "single" in args.families:
            run.single(x)
        if "megacp" in args.families:
            run.megacp(x, rings)
        if peers.torch_cp is not None:
            run.torch_cp(x, peers)
        if peers.te is not None:
            run.te(x, peers)
        if peers.ulysses is not None:
            run.ulysses(x, peers)
        del x
        bh.free(ctx)
    if ctx.rank == 0:
        run.efficiencies()
    run.print_summary()
    failed = not bh.agree(ctx, not run.megacp_fail)
    bh.finish(ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
