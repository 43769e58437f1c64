#!/usr/bin/env python3
"""New tokens after a cached prefix (a chunk, a chat turn): FlashAttention-2's varlen forward
against its batched forward, the one :func:`megacp.attention.kernels.varlen.varlen_attention` runs for such
a tile, on one GPU.

    python -m scripts.diagnostics.prefix_attention            # prefixes 8K/32K/128K, 1..2048 queries

Both calls compute the same causal tile (``q`` rows after ``prefix`` cached keys; bf16, 32 query
and 8 KV heads of 128 by default). The varlen call runs each head's queries on one SM over every
key; the batched call splits the keys over the SMs when the queries are few (split-KV) and merges.
Checked first against an fp32 reference on small shapes (largest |out| and |LSE| error), then each
call timed (CUDA events over back-to-back calls, microseconds) with the time to read K and V once
at the given memory bandwidth for scale.
"""

from __future__ import annotations

import argparse
import math

import torch

from scripts.bench import harness as bh


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [Sq, H, D]``, ``lse [Sq, H]`` of the tile through the varlen call (one sequence)."""
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], 0.0, True,
                                                       False, scale=scale)[:2]
    return out, (lse.t() if lse.dim() == 2 else lse[0].t())


def batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through the batched (non-varlen) call, a batch of one."""
    out, lse = torch.ops.aten._flash_attention_forward(q[None], k[None], v[None], None, None, q.shape[0],
                                                       k.shape[0], 0.0, True, False, scale=scale)[:2]
    return out[0], lse[0].t()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention of ``q`` over ``k``/``v``, query ``i`` seeing keys up to ``Sk - Sq + i``."""
    sq, sk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qf, kf, vf = (x.float().transpose(0, 1) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
    s = qf @ kf.transpose(1, 2) * scale
    hidden = torch.arange(sk, device=q.device)[None] > torch.arange(sq, device=q.device)[:, None] + sk - sq
    s = s.masked_fill(hidden, float("-inf"))
    return (s.softmax(-1) @ vf).transpose(0, 1), torch.logsumexp(s, -1).t()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", type=bh.parse_sizes, default="8K,32K,128K")
    p.add_argument("--queries", default="1,16,64,96,256,512,2048")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bandwidth-tbs", type=float, default=3.35, help="memory bandwidth for the K/V read time (TB/s)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this diagnostic times FlashAttention-2 on a CUDA GPU", flush=True)
        return 2
    ctx = bh.init("cuda", "bf16")
    dev, dt = ctx.device, torch.bfloat16
    h, hk, d = args.heads, args.kv_heads, args.head_dim
    scale = 1 / math.sqrt(d)
    g = torch.Generator(device=dev).manual_seed(0)
    for sq, sk in ((96, 1000), (5, 3000), (700, 2000)):
        q = torch.randn(sq, h, d, device=dev, dtype=dt, generator=g)
        k, v = (torch.randn(sk, hk, d, device=dev, dtype=dt, generator=g) for _ in range(2))
        want, want_lse = reference(q, k, v, scale)
        for name, fn in (("varlen", varlen), ("batched", batched)):
            out, lse = fn(q, k, v, scale)
            print(f"check {sq} queries x {sk} keys, {name:7s}: |out - ref| {(out.float() - want).abs().max().item():.4f}"
                  f"  |lse - ref| {(lse.float() - want_lse).abs().max().item():.6f}", flush=True)
    print(f"\n{'prefix':>7} {'queries':>7} {'varlen us':>10} {'batched us':>10} {'ratio':>6} {'K/V read us':>11}")
    for prefix in args.prefixes:
        for sq in (int(x) for x in args.queries.split(",")):
            sk = prefix + sq
            q = torch.randn(sq, h, d, device=dev, dtype=dt)
            k, v = (torch.randn(sk, hk, d, device=dev, dtype=dt) for _ in range(2))
            a, b = (bh.measure_loop(ctx, lambda fn=fn, q=q, k=k, v=v: fn(q, k, v, scale), calls=50, collective=False)
                    for fn in (varlen, batched))
            read_us = 2 * sk * hk * d * 2 / (args.bandwidth_tbs * 1e12) * 1e6
            print(f"{prefix:7d} {sq:7d} {a * 1e3:10.1f} {b * 1e3:10.1f} {a / b:6.1f} {read_us:11.1f}", flush=True)
    bh.finish(ctx)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
