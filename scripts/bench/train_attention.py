#!/usr/bin/env python3
"""Training attention on one GPU: forward+backward of megacp's ring against SDPA, and the per-rank
tile work of CP=2 against the zero-communication bound, all measured in one run.

Shape: Llama-3-8B attention (32 Q / 8 KV heads, head dim 128), bf16, causal, batch 1, ``[S, H, D]``
tensors (the layout a model hands its attention layer).

    python -m scripts.bench.train_attention --sizes 16K,32K,64K,128K --json out/train_attention.json

Rows (every time is forward + backward, each call timed alone):

* ``sdpa_cudnn`` / ``sdpa_flash`` — ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``
  under ``sdpa_kernel`` on the whole sequence; ``sdpa_cudnn`` is T1.
* ``megacp_cp1`` — :func:`megacp.attention.ring_attention` at CP=1 (backend ``auto``: the cuDNN
  kernels forward and backward).
* ``megacp_cp2_rank{0,1}`` — what a CP=2 rank computes, on one GPU: its queries (two load-balanced
  chunks) over its own block and over the other rank's block — the ring's tiles
  (``plan.tiles``) through :func:`~megacp.attention.kernels.tile_attention.run_tiles` and the fused
  backward :func:`~megacp.attention.training.block_gradients`, with the merge and the fp32
  gradient accumulation (:func:`~megacp.attention.training.accumulate`); no communication. Efficiency T1 / (2 · T_rank), T_rank the slower rank.
* ``bound_cp2`` — the zero-communication bound of one CP=2 rank: SDPA cuDNN forward+backward of a
  causal S/2 call plus a dense (S/4 queries × S/2 keys) call, timed alone; efficiency bound
  T1 / (2 · T_bound).

TFLOP/s count the backward as 2.5 forwards (forward FLOPs ``4·S²·H·D``, halved when causal).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megacp.attention import ring_attention
from megacp.attention.kernels.tile_attention import run_tiles
from megacp.attention.training import accumulate, block_gradients
from megacp.placement import ShardPlan
from scripts.bench import harness as bh

BWD_FACTOR = 3.5
"""Forward + backward FLOPs in units of the forward's."""


def fwd_bwd(f: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dout: torch.Tensor) -> Callable[[], None]:
    """A call that runs ``f(*inputs)`` and its backward with ``dout`` (gradients dropped each call)."""
    def run() -> None:
        for x in inputs:
            x.grad = None
        f(*inputs).backward(dout)
    return run


def sdpa(backend: SDPBackend, causal: bool = True) -> Callable[..., torch.Tensor]:
    """SDPA on ``[S, H, D]`` tensors (viewed as ``[1, H, S, D]``) with one kernel forced."""
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(*(x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)),
                                               is_causal=causal, enable_gqa=True)
        return o.transpose(1, 2)[0]
    return f


def rank_work(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, plan: ShardPlan,
              idx: list[torch.Tensor], backend: str | None = None) -> Callable[[], None]:
    """One CP rank's tiles forward and backward over every rank's block, computed locally
    (``backend``: the attention kernels, :mod:`megacp.attention.kernels.partial`)."""
    r, n = plan.rank, plan.cp_size
    qr, dor = q[idx[r]].contiguous(), dout[idx[r]].contiguous()
    blocks = [(k[i].contiguous(), v[i].contiguous()) for i in idx]
    order = [(r - s) % n for s in range(n)]

    def run() -> None:
        state = None
        for j in order:
            state = run_tiles(qr, *blocks[j], plan.tiles(r, j), state, backend=backend)
        out, lse = state[0].to(qr.dtype), state[1]
        dq = None
        for j in order:
            pq, pk, pv = block_gradients(qr, blocks[j], out, lse, dor, plan.tiles(r, j), scale=None, backend=backend)
            dq = accumulate(dq, pq, qr.shape, qr.device, qr.dtype if n == 2 else torch.float32)
            for pieces in (pk, pv):
                accumulate(None, pieces, blocks[j][0].shape, qr.device)
        dq.to(qr.dtype)
    return run


def bench_size(ctx: bh.Ctx, rep: bh.Report, s: int, args: argparse.Namespace) -> list[dict]:
    dt, dev, h, hkv, d = ctx.dtype, ctx.device, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device=dev).manual_seed(args.seed)
    q, k, v, dout = (torch.randn(s, x, d, generator=g, device=dev, dtype=dt) for x in (h, hkv, hkv, h))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    causal_flops = BWD_FACTOR * bh.attn_flops(s, h, d, causal=True)
    rows = []

    def time(method: str, fn: Callable[[], None], flops: float) -> dict | None:
        try:
            tm = bh.measure(ctx, fn, collective=False, target_s=args.target_s)
        except Exception as exc:  # noqa: BLE001 - a method that cannot run is recorded, the rest go on
            rep.error(method, exc, seqlen=s)
            return None
        row = {"seqlen": s, "method": method, "ms": tm.ms, "tflops": flops / tm.ms / 1e9, **tm.as_dict()}
        rep.result(row)
        rows.append(row)
        return row

    t1 = time("sdpa_cudnn", fwd_bwd(sdpa(SDPBackend.CUDNN_ATTENTION), [q, k, v], dout), causal_flops)
    time("sdpa_flash", fwd_bwd(sdpa(SDPBackend.FLASH_ATTENTION), [q, k, v], dout), causal_flops)
    plan1 = ShardPlan([0], [s], 1, 0)
    time("megacp_cp1", fwd_bwd(lambda a, b, c: ring_attention(a, b, c, plan1, None), [q, k, v], dout), causal_flops)
    plans = [ShardPlan([0], [s], 2, r) for r in range(2)]
    idx = [p.local_index().to(dev) for p in plans]
    ranks = [time(f"megacp_cp2_rank{r}", rank_work(q.detach(), k.detach(), v.detach(), dout, plans[r], idx),
                  causal_flops / 2) for r in range(2)]
    half, quarter = s // 2, s // 4
    qc, kc, vc = (torch.randn(half, x, d, generator=g, device=dev, dtype=dt, requires_grad=True) for x in (h, hkv, hkv))
    qd = torch.randn(quarter, h, d, generator=g, device=dev, dtype=dt, requires_grad=True)
    causal_part = fwd_bwd(sdpa(SDPBackend.CUDNN_ATTENTION), [qc, kc, vc], torch.randn_like(qc))
    dense_part = fwd_bwd(sdpa(SDPBackend.CUDNN_ATTENTION, causal=False), [qd, kc, vc], torch.randn_like(qd))
    bound = time("bound_cp2", lambda: (causal_part(), dense_part()), causal_flops / 2)
    if t1 is not None:
        for row in rows:
            row["t1_ratio"] = t1["ms"] / row["ms"]
        slowest = max((x["ms"] for x in ranks if x is not None), default=None)
        eff = {"seqlen": s, "method": "cp2_efficiency",
               "megacp": t1["ms"] / (2 * slowest) if slowest else None,
               "bound": t1["ms"] / (2 * bound["ms"]) if bound else None}
        rep.result(eff)
        rows.append(eff)
    del q, k, v, dout, qc, kc, vc, qd
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bh.add_common_args(p)
    p.add_argument("--sizes", type=bh.parse_sizes, default=bh.parse_sizes("16K,32K,64K,128K"))
    p.add_argument("--target-s", type=float, default=1.5, help="seconds of timed calls per method")
    args = p.parse_args(argv)
    if args.device != "cuda":
        print("error: the training-attention benchmark times fused GPU kernels: --device cuda", file=sys.stderr)
        return 2
    ctx = bh.init(args.device, args.dtype)
    rep = bh.Report(ctx, args.json, {**bh.env_info(ctx), "kind": "train_attention", "argv": sys.argv})
    rows = []
    for s in args.sizes:
        ctx.log(f"S={bh.size_label(s)}")
        rows += bench_size(ctx, rep, s, args)
    bh.print_table(ctx, [r for r in rows if "ms" in r],
                   [("seqlen", "S", "d"), ("method", "method", "s"), ("ms", "ms", ".2f"),
                    ("tflops", "TFLOP/s", ".0f"), ("t1_ratio", "T1/T", ".3f")], "forward+backward")
    bh.print_table(ctx, [r for r in rows if r["method"] == "cp2_efficiency"],
                   [("seqlen", "S", "d"), ("megacp", "megacp T1/(2·T_rank)", ".3f"), ("bound", "bound", ".3f")],
                   "CP=2 per-rank tile work")
    bh.finish(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
