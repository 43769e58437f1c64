#!/usr/bin/env python3
"""Causal prefill attention: best single GPU vs megacp pass-KV / pass-Q vs the CP of PyTorch,
Transformer Engine and DeepSpeed-Ulysses, all measured in one run.

Shape: Llama-3-8B attention (32 Q / 8 KV heads, head dim 128), bf16, causal, batch 1.

    torchrun --nproc_per_node 2 scripts/bench_prefill.py --json out/prefill.json [--check]

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
import inspect
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402  (puts the repo root on sys.path)

from megacp.attention import ShardPlan, build_kv_block, cp_prefill, partial_attention  # noqa: E402
from megacp.parallel.ring import Ring  # noqa: E402

FAMILIES = ("single", "megacp", "torch", "te", "ds")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(p)
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
    return p.parse_args(argv)


# --------------------------------------------------------------------------- layouts


def lb_index(s: int, n: int, r: int) -> torch.Tensor:
    """Rows of rank r in the 2N-chunk load-balanced layout (chunks r and 2N-1-r) — TE's layout."""
    c = s // (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])


def contiguous_index(s: int, n: int, r: int) -> torch.Tensor:
    c = s // n
    return torch.arange(r * c, (r + 1) * c)


# --------------------------------------------------------------------------- peers


class TorchCP:
    """PyTorch's native CP (``context_parallel``)."""

    def __init__(self, ctx: bc.Ctx, args) -> None:
        self.ctx, self.args = ctx, args
        self.reason = None
        self.gqa: dict[str, bool] = {}  # per SDPA backend: native enable_gqa works
        if not ctx.cuda:
            self.reason = "PyTorch CP dispatches only the CUDA SDPA kernels (flash / efficient / cuDNN)"
            return
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental import context_parallel
            from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.context_parallel, self.unshard, self.set_rotate = context_parallel, context_parallel_unshard, set_rotate_method
            self.sdpa_kernel = sdpa_kernel
            self.kernels = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                            "efficient": SDPBackend.EFFICIENT_ATTENTION}
            self.mesh = init_device_mesh("cuda", (ctx.world,), mesh_dim_names=("cp",))
        except Exception as e:  # noqa: BLE001
            self.reason = f"torch.distributed.tensor.experimental.context_parallel unavailable: {type(e).__name__}: {e}"

    def run(self, q, k, v, backend: str, rotate: str, gqa: bool, timing: dict | None, want_out: bool):
        """q/k/v: full ``[S, H(kv), D]`` on every rank. Returns (Timing | None, full output | None)."""
        h, hkv = q.shape[1], k.shape[1]
        qt = q.permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, H, S, D]
        kt = k.permute(1, 0, 2).unsqueeze(0)
        vt = v.permute(1, 0, 2).unsqueeze(0)
        if not gqa and h != hkv:
            kt, vt = kt.repeat_interleave(h // hkv, dim=1), vt.repeat_interleave(h // hkv, dim=1)
        kt, vt = kt.contiguous(), vt.contiguous()
        bufs = [qt, kt, vt]
        tm, out = None, None
        self.set_rotate(rotate)
        try:
            with self.context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(bufs)):
                with self.sdpa_kernel([self.kernels[backend]]):
                    # attribute lookup at call time: context_parallel patches F.scaled_dot_product_attention
                    def fn():
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)

                    if timing is not None:
                        tm = bc.measure(self.ctx, fn, **timing)
                    if want_out:
                        out = fn()
        finally:
            self.set_rotate("allgather")
        full = None
        if out is not None:
            full = self.unshard(self.mesh, [out.contiguous()], [2])[0][0].permute(1, 0, 2).contiguous()
        return tm, full

    def probe_gqa(self, backend: str, h: int, hkv: int, d: int) -> tuple[bool, str]:
        """Does ``enable_gqa=True`` run and give the right answer under torch's CP (small S)?"""
        ctx = self.ctx
        s = 2048 * ctx.world
        q = bc.shared_randn((s, h, d), ctx, 11)
        k = bc.shared_randn((s, hkv, d), ctx, 12)
        v = bc.shared_randn((s, hkv, d), ctx, 13)
        try:
            _, full = self.run(q, k, v, backend, "allgather", True, None, True)
            ok_run = True
        except Exception as e:  # noqa: BLE001
            full, ok_run, why = None, False, f"{type(e).__name__}: {str(e)[:300]}"
        if not bc.agree(ctx, ok_run):
            return False, f"enable_gqa=True fails under torch CP ({why if not ok_run else 'on another rank'})"
        with self.sdpa_kernel([self.kernels[backend]]):
            ref = F.scaled_dot_product_attention(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None],
                                                 v.permute(1, 0, 2)[None], is_causal=True, enable_gqa=True)
        ref = ref[0].permute(1, 0, 2)
        err = bc.diff_stats(full, ref)["max_abs"]
        good = bc.agree(ctx, err == err and err < 0.1)
        if good:
            return True, "native enable_gqa=True"
        return False, f"enable_gqa=True gives wrong output under torch CP (max err {err:.3g})"


class TransformerEngineCP:
    def __init__(self, ctx: bc.Ctx) -> None:
        self.ctx, self.reason, self.te = ctx, None, None
        if not ctx.cuda:
            self.reason = "Transformer Engine needs CUDA"
        else:
            try:
                import transformer_engine
                import transformer_engine.pytorch as te

                self.te = te
                self.version = getattr(transformer_engine, "__version__", "?")
            except Exception as e:  # noqa: BLE001
                self.reason = f"import transformer_engine.pytorch failed: {type(e).__name__}: {str(e)[:300]}"
        if not bc.agree(ctx, self.reason is None) and self.reason is None:
            self.reason = "Transformer Engine unavailable on another rank"

    def module(self, h: int, hkv: int, d: int, comm: str):
        dpa = self.te.DotProductAttention(h, d, num_gqa_groups=hkv, attn_mask_type="causal", qkv_format="bshd")
        dpa = dpa.to(self.ctx.device)
        ranks = list(range(self.ctx.world))
        dpa.set_context_parallel_group(self.ctx.group, ranks, torch.cuda.Stream(device=self.ctx.device), comm)
        return dpa


class UlyssesCP:
    def __init__(self, ctx: bc.Ctx) -> None:
        self.ctx, self.reason = ctx, None
        if not ctx.cuda:
            self.reason = "the DeepSpeed-Ulysses comparison uses CUDA SDPA (cuDNN) as its local attention"
        else:
            os.environ.setdefault("DS_ACCELERATOR", "cuda")
            try:
                import deepspeed
                import deepspeed.comm as dscomm
                from deepspeed.sequence.layer import DistributedAttention

                try:
                    dscomm.init_distributed(dist_backend=ctx.backend, auto_mpi_discovery=False, verbose=False)
                except TypeError:
                    dscomm.init_distributed(ctx.backend)
                self.cls = DistributedAttention
                self.version = getattr(deepspeed, "__version__", "?")
                self.takes_batch_dim = "batch_dim_idx" in inspect.signature(DistributedAttention.forward).parameters
            except Exception as e:  # noqa: BLE001
                self.reason = f"deepspeed unavailable: {type(e).__name__}: {str(e)[:300]}"
        if not bc.agree(ctx, self.reason is None) and self.reason is None:
            self.reason = "deepspeed unavailable on another rank"

    def module(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        class LocalSDPA(torch.nn.Module):
            """Seq-first ``[S, B, h, D]`` in and out; cuDNN SDPA with GQA inside."""

            def forward(self, q, k, v, *args, **kwargs):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    o = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                                       is_causal=True, enable_gqa=True)
                return o.permute(2, 0, 1, 3)

        # seq-first layout: scatter heads (dim 2), gather sequence (dim 0) — DeepSpeed's defaults
        return self.cls(LocalSDPA(), self.ctx.group, scatter_idx=2, gather_idx=0)

    def call(self, mod, q, k, v):
        return mod(q, k, v, 1) if self.takes_batch_dim else mod(q, k, v)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = bc.init_dist(args.device, args.dtype, args.pg_timeout)
    n, r = ctx.world, ctx.rank
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    seqlens = bc.parse_sizes(args.seqlens)
    families = bc.parse_names(args.methods)
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        raise SystemExit(f"unknown --methods {bad}; choose from {FAMILIES}")
    single_backends = bc.parse_names(args.single_backends or ("cudnn,flash" if ctx.cuda else "reference"))
    timing = dict(warmup=args.warmup, min_iters=args.min_iters, max_iters=args.max_iters, target_s=args.target_s,
                  loop_calls=args.loop)
    meta = bc.env_info(ctx)
    meta.update(kind="prefill", heads=h, kv_heads=hkv, head_dim=d, batch=1, causal=True, seqlens=seqlens,
                cp_size=n, families=families, timing=timing, check=args.check)
    rep = bc.Report(ctx, args.json, meta)
    ctx.log(f"prefill benchmark: {meta.get('gpu', 'cpu')} x{n}, torch {torch.__version__}, {ctx.dtype}, "
            f"H={h} Hkv={hkv} D={d}, S={','.join(map(bc.size_label, seqlens))}, families={families}")
    for s in seqlens:
        if s % (2 * n):
            raise SystemExit(f"seqlen {s} must be a multiple of 2N = {2 * n}")

    # ---- peers: availability, agreed on every rank
    torch_cp = TorchCP(ctx, args) if "torch" in families else None
    if torch_cp is not None and not bc.agree(ctx, torch_cp.reason is None) and torch_cp.reason is None:
        torch_cp.reason = "unavailable on another rank"
    te_cp = TransformerEngineCP(ctx) if "te" in families else None
    ds_cp = UlyssesCP(ctx) if "ds" in families else None
    torch_backends = bc.parse_names(args.torch_backends)
    if torch_cp is not None and torch_cp.reason is None:
        for be in torch_backends:
            try:
                good, how = torch_cp.probe_gqa(be, h, hkv, d)
            except Exception as e:  # noqa: BLE001
                good, how = False, f"probe failed: {type(e).__name__}: {str(e)[:200]}"
            torch_cp.gqa[be] = good
            msg = how if good else f"KV heads repeated {h // hkv}x ({how})"
            rep.note(f"torch_cp_gqa_{be}", msg)
            ctx.log(f"torch CP ({be}) GQA: {msg}")
    if te_cp is not None and te_cp.reason is None:
        rep.note("transformer_engine", te_cp.version)
    if ds_cp is not None and ds_cp.reason is None:
        rep.note("deepspeed", f"{ds_cp.version} (forward takes batch_dim_idx: {ds_cp.takes_batch_dim})")

    transports = bc.parse_names(args.transports)
    rings: dict[str, Ring | None] = {}
    if "megacp" in families:
        for tr in transports:
            if n == 1:
                rings[tr] = None
            elif tr == "nccl_hp":
                if ctx.backend != "nccl":
                    raise SystemExit("--transports nccl_hp needs NCCL (--device cuda)")
                opts = dist.ProcessGroupNCCL.Options()
                opts.is_high_priority_stream = True
                rings[tr] = Ring(dist.new_group(list(range(n)), pg_options=opts), transport="nccl")
            else:
                rings[tr] = Ring(ctx.group, transport=tr)
            ctx.log(f"megacp ring transport {tr}: {rings[tr].transport if rings[tr] else '-'}")

    rows: list[dict] = []
    checks: list[dict] = []
    megacp_fail = False

    def add(s, method, tm: bc.Timing, per_gpu_div: int, note: str = ""):
        tf = bc.attn_flops(s, h, d) / per_gpu_div / (tm.ms * 1e-3) / 1e12
        row = {"seqlen": s, "method": method, "ms": tm.ms, "min_ms": tm.min_ms, "max_ms": tm.max_ms, "iters": tm.iters,
               "tflops_per_gpu": tf, "note": note, "times_ms": [round(t, 4) for t in tm.times_ms], "loop_ms": tm.loop_ms}
        rows.append(row)
        rep.result(row)
        ctx.log(f"  {method:28s} {tm.ms:10.3f} ms  {bc.fmt(tf, '7.1f'):>7s} TFLOP/s/GPU  ({tm.iters} iters) {note}")
        return row

    for s in seqlens:
        label = bc.size_label(s)
        ctx.log(f"\n=== S = {label} ({s}) ===")
        q = bc.shared_randn((s, h, d), ctx, args.seed + 1)
        k = bc.shared_randn((s, hkv, d), ctx, args.seed + 2)
        v = bc.shared_randn((s, hkv, d), ctx, args.seed + 3)
        ref, noise = None, None  # rank 0: single-GPU output of the first backend; flash-vs-it max error

        def compare(method, full, s=s):
            nonlocal megacp_fail
            if ctx.rank == 0 and ref is not None and full is not None:
                st = bc.diff_stats(full, ref)
                ratio = st["max_abs"] / noise if noise else None
                tol = bc.tolerance(ref, noise, ctx.dtype)
                ok = st["max_abs"] == st["max_abs"] and st["max_abs"] <= tol
                row = {"seqlen": s, "method": method, **st, "ref": f"single_{single_backends[0]}",
                       "noise_max_abs": noise, "ratio_to_noise": ratio, "tol": tol, "ok": ok}
                checks.append(row)
                rep.check(row)
                print(f"  check {method:22s} max|err| {st['max_abs']:.3e} mean {st['mean_abs']:.3e}"
                      f" (noise {bc.fmt(noise, '.3e')}, x{bc.fmt(ratio, '.2f')}) {'ok' if ok else 'MISMATCH'}", flush=True)
                if method.startswith("megacp") and not ok:
                    megacp_fail = True

        # (a) single GPU, rank 0 alone
        if "single" in families:
            if ctx.rank == 0:
                for be in single_backends:
                    try:
                        def fn(be=be):
                            return partial_attention(q, k, v, causal=True, backend=be)

                        add(s, f"single_{be}", bc.measure(ctx, fn, collective=False, **timing), 1, "rank 0 alone")
                        if args.check:
                            out = fn()[0]
                            if ref is None:
                                ref = out
                            else:
                                st = bc.diff_stats(out, ref)
                                noise = st["max_abs"] if noise is None else max(noise, st["max_abs"])
                                print(f"  noise single_{be} vs single_{single_backends[0]}: max|err| {st['max_abs']:.3e}"
                                      f" mean {st['mean_abs']:.3e}", flush=True)
                            del out
                    except Exception as e:  # noqa: BLE001 - rank-local, the others wait at the barrier
                        rep.error(f"single_{be}", e, seqlen=s)
                bc.free(ctx)
            bc.barrier(ctx)
            for j in range(1, n):  # the same call on every other GPU, one at a time
                tm = None
                if ctx.rank == j:
                    tm = bc.measure(ctx, lambda: partial_attention(q, k, v, causal=True, backend=single_backends[0]),
                                    collective=False, **timing)
                    bc.free(ctx)
                tm = bc.bcast_obj(ctx, tm, src=j)
                if ctx.rank == 0:
                    add(s, f"single_{single_backends[0]}@rank{j}", tm, 1,
                        f"rank {j} alone (diagnostic, not T1)")["diagnostic"] = True
                bc.barrier(ctx)

        # shards: 2N-chunk load-balanced (megacp, TE), contiguous (Ulysses)
        plan = ShardPlan([0], [s], n, r)
        idx = [plan.local_index(j) for j in range(n)]
        if not all(torch.equal(idx[j], lb_index(s, n, j)) for j in range(n)):
            raise RuntimeError("megacp's load-balanced layout differs from the 2N-chunk layout TE expects")
        my = idx[r].to(ctx.device)
        ql, kl, vl = q[my], k[my], v[my]

        # (b) megacp
        if "megacp" in families:
            try:
                for strat in bc.parse_names(args.strategies):
                    for ti, tr in enumerate(transports):
                        name = f"megacp_{strat}" if ti == 0 else f"megacp_{strat}[{tr}]"
                        try:
                            ring = rings[tr]

                            def fn(strat=strat, ring=ring):
                                kv_block = build_kv_block(plan, kl, vl)  # (kl, vl) themselves: no copy
                                return cp_prefill(ql, kv_block, plan, ring, strategy=strat, backend=args.megacp_backend)

                            add(s, name, bc.measure(ctx, fn, **timing), n, f"transport {ring.transport if ring else '-'}")
                            if args.check:
                                compare(name, bc.gather_rows(ctx, fn(), idx, s))
                        except Exception as e:  # noqa: BLE001
                            rep.error(name, e, seqlen=s)
            except Exception as e:  # noqa: BLE001
                rep.error("megacp", e, seqlen=s)
            bc.free(ctx)
            bc.barrier(ctx)

        # (c) PyTorch CP
        if torch_cp is not None:
            if torch_cp.reason:
                if s == seqlens[0]:
                    rep.skip("torch_cp", torch_cp.reason)
            else:
                for be in torch_backends:
                    for rot in bc.parse_names(args.torch_rotate):
                        name = f"torch_cp_{be}_{rot}"
                        gqa = torch_cp.gqa.get(be, False)
                        try:
                            tm, full = torch_cp.run(q, k, v, be, rot, gqa, timing, args.check)
                            add(s, name, tm, n, "enable_gqa" if gqa else f"KV repeated {h // hkv}x")
                            compare(name, full)
                            del full
                        except Exception as e:  # noqa: BLE001
                            rep.error(name, e, seqlen=s)
                        bc.free(ctx)
                        bc.barrier(ctx)

        # (d) Transformer Engine CP
        if te_cp is not None:
            if te_cp.reason:
                if s == seqlens[0]:
                    rep.skip("te", te_cp.reason)
            else:
                qb, kb, vb = ql.unsqueeze(0), kl.unsqueeze(0), vl.unsqueeze(0)  # [1, S/N, H, D], 2N-chunk layout
                for comm in bc.parse_names(args.te_comm):
                    name = f"te_{comm}"
                    try:
                        dpa = te_cp.module(h, hkv, d, comm)
                        with torch.no_grad():
                            def fn(dpa=dpa):
                                return dpa(qb, kb, vb)

                            add(s, name, bc.measure(ctx, fn, **timing), n, f"TE {te_cp.version}")
                            if args.check:
                                compare(name, bc.gather_rows(ctx, fn().reshape(-1, h, d), idx, s))
                        del dpa
                    except Exception as e:  # noqa: BLE001
                        rep.error(name, e, seqlen=s)
                    bc.free(ctx)
                    bc.barrier(ctx)

        # (e) DeepSpeed-Ulysses
        if ds_cp is not None:
            if ds_cp.reason:
                if s == seqlens[0]:
                    rep.skip("ds_ulysses", ds_cp.reason)
            elif h % n or hkv % n:
                if s == seqlens[0]:
                    rep.skip("ds_ulysses", f"Ulysses needs heads divisible by N ({h}, {hkv}, N={n})")
            else:
                cidx = [contiguous_index(s, n, j) for j in range(n)]
                sl = slice(r * (s // n), (r + 1) * (s // n))
                qs, ks, vs = q[sl].unsqueeze(1), k[sl].unsqueeze(1), v[sl].unsqueeze(1)  # [S/N, 1, H, D]
                try:
                    mod = ds_cp.module()
                    with torch.no_grad():
                        def fn(mod=mod):
                            return ds_cp.call(mod, qs, ks, vs)

                        add(s, "ds_ulysses_cudnn", bc.measure(ctx, fn, **timing), n, f"DeepSpeed {ds_cp.version}")
                        if args.check:
                            compare("ds_ulysses_cudnn", bc.gather_rows(ctx, fn().reshape(-1, h, d), cidx, s))
                except Exception as e:  # noqa: BLE001
                    rep.error("ds_ulysses_cudnn", e, seqlen=s)
                del qs, ks, vs
                bc.free(ctx)
                bc.barrier(ctx)

        del q, k, v, ql, kl, vl, ref
        bc.free(ctx)

    # ---- summary
    if ctx.rank == 0:
        for s in seqlens:
            singles = [x for x in rows if x["seqlen"] == s and x["method"].startswith("single_")
                       and not x.get("diagnostic")]
            t1 = min((x["ms"] for x in singles), default=None)
            t1_loop = min((x["loop_ms"] for x in singles if x.get("loop_ms")), default=None)
            for x in rows:
                if x["seqlen"] != s:
                    continue
                x["seqlen_label"] = bc.size_label(s)
                x["efficiency"] = x["loop_efficiency"] = None
                if t1 and not x["method"].startswith("single_"):
                    x["efficiency"] = t1 / (n * x["ms"])
                    if t1_loop and x.get("loop_ms"):
                        x["loop_efficiency"] = t1_loop / (n * x["loop_ms"])
                if t1:
                    x["t1_ms"] = t1
        rep._save()
    loop_cols = [("loop_ms", "loop ms", ".3f"), ("loop_efficiency", "loop eff", ".3f")] if args.loop else []
    bc.print_table(ctx, rows, [("seqlen_label", "seqlen", ""), ("method", "method", ""), ("ms", "ms", ".3f"),
                               ("tflops_per_gpu", "TFLOP/s/GPU", ".1f"), ("efficiency", f"eff T1/({n}T)", ".3f"),
                               *loop_cols, ("iters", "iters", ""), ("note", "note", "")],
                   title=f"Causal prefill, H={h}/{hkv} D={d} {str(ctx.dtype).replace('torch.', '')}, CP={n}")
    if args.check:
        bc.print_table(ctx, checks, [("seqlen", "seqlen", ""), ("method", "method", ""), ("max_abs", "max|err|", ".3e"),
                                     ("mean_abs", "mean|err|", ".3e"), ("noise_max_abs", "noise", ".3e"),
                                     ("ratio_to_noise", "x noise", ".2f"), ("ok", "ok", "")],
                       title="Outputs vs single-GPU (noise = flash vs cuDNN on one GPU)")
    skipped = rep.data["skipped"]
    errors = rep.data["errors"]
    if ctx.rank == 0:
        for sk in skipped:
            print(f"skipped: {sk['method']}: {sk['reason']}")
        for er in errors:
            print(f"error: {er['method']} (S={er.get('seqlen')}): {er['error'][:300]}")
        if args.json:
            print(f"JSON: {args.json}")
        print("megacp check: " + ("FAIL" if megacp_fail else "ok" if args.check else "not run"), flush=True)
    failed = bc.agree(ctx, not megacp_fail) is False
    bc.finish(ctx)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
