"""Banded (sliding-window) tiles on one GPU: the batched square cuDNN calls
(:mod:`megacp.attention.kernels.band`, backend ``"cudnn"``) against FlashAttention-2's window (``"flash"``),
both judged against the exact fp32 reference, bf16, forward out/LSE and backward dq/dk/dv.

    python -m tests.programs.band_check                 # one GPU: the tiles of 64K tokens, 4096-token window
    python -m tests.programs.band_check --tiny          # CPU smoke run (the causal calls on the reference)

Tiles: those the window plan gives a ``--seq-len`` sequence at CP 1 and CP 2 (32 Q / 8 KV heads of
128), a chunk after a window's history (Lk = Lq + window - 1), a tile whose last block is short, and
a band narrower than a kernel tile. Backward inputs are the exact final out/LSE (as the ring feeds
them). Criterion per tensor (bf16 has no exact answer, so the cuDNN pieces are judged against FA2's
own error): every value finite, ``max|cudnn - exact| <= 2 · max|flash - exact| + floor`` (floor 2e-3
for out/LSE, 5e-3 · max|exact| for gradients); and the same ``-inf`` LSE rows. Prints one
``PASS``/``FAIL`` line per tile and tensor with both errors; exit status 1 when any fails.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import Tensor

from megacp.attention.kernels import partial as pa
from megacp.attention.kernels import partial_backward as pb
from megacp.attention.kernels.band import band_attention, band_backward
from megacp.placement import ShardPlan
from scripts.bench import harness as bh


def tiles(s: int, window: int) -> list[tuple[int, int, bool, int]]:
    """Distinct ``(Lq, Lk, causal, left)`` of the window plans of one ``s``-token sequence at CP 1
    and 2, plus a chunk after a history, a short last block and a narrow band."""
    found = {(t.q1 - t.q0, t.k1 - t.k0, t.causal, t.left) for cp in (1, 2) for r in range(cp)
             for j in range(cp) for t in ShardPlan([0], [s], cp, r).with_window(window).tiles(r, j)}
    w = window - 1
    extra = {(s // 8, s // 8 + w, True, w), (s // 8 + window // 3, s // 8 + window // 3, True, w),
             (s // 16, s // 16, True, min(w, 63))}
    return sorted(t for t in found | extra if t[3] is not None)


def run(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, out: Tensor, lse: Tensor, causal: bool, left: int,
        backend: str, tiny: bool) -> list[Tensor]:
    """Forward (out, lse) and backward (dq, dk, dv) of one banded tile under ``backend`` (``--tiny``:
    the band pieces over the reference, and the banded reference)."""
    if not tiny:
        o, l = pa.partial_attention(q, k, v, causal=causal, left=left, backend=backend)
        grads = pb.partial_attention_backward(q, k, v, out, lse, dout, causal=causal, left=left, backend=backend)
        return [o, l, *grads]
    scale = q.shape[-1] ** -0.5
    if backend == "flash":
        o, l = pa._reference(q, k, v, causal=causal, scale=scale, left=left)
        return [o, l, *pb.reference_backward(q, k, v, out, lse, dout, causal=causal, scale=scale, left=left)]
    o, l = band_attention(q, k, v, causal=causal, left=left,
                          attend=lambda a, b, c, m: pa._reference_batched(a, b, c, causal=m, scale=scale))

    def grads(a: Tensor, b: Tensor, c: Tensor, o_: Tensor, l_: Tensor, d_: Tensor, m: bool) -> tuple[Tensor, Tensor, Tensor]:
        if a.dim() == 3:
            return pb.reference_backward(a, b, c, o_, l_, d_, causal=m, scale=scale)
        gs = [pb.reference_backward(*xs, causal=m, scale=scale) for xs in zip(a, b, c, o_, l_, d_)]
        dq, dk, dv = (torch.stack(g) for g in zip(*gs))
        return dq, dk, dv

    return [o, l, *band_backward(q, k, v, out, lse, dout, causal=causal, left=left, grads=grads)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=bh.parse_sizes, default=bh.parse_sizes("64K"), help="one size")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="CPU, fp32, 512 tokens, window 160, 4 / 2 heads of 16")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.window, args.heads, args.kv_heads, args.head_dim = [512], 160, 4, 2, 16
    elif not torch.cuda.is_available():
        print("error: band_check compares GPU kernels; --tiny runs it on CPU", file=sys.stderr)
        return 2
    s, window = args.seq_len[0], args.window
    if not 2 <= window < s or args.heads % args.kv_heads:
        print(f"error: need 2 <= --window < {s} and heads divisible by kv heads", file=sys.stderr)
        return 2
    dev, dt = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    failed = 0
    for lq, lk, causal, left in tiles(s, window):
        q, dout = (torch.randn(lq, args.heads, args.head_dim, generator=g, device=dev, dtype=dt) for _ in range(2))
        k, v = (torch.randn(lk, args.kv_heads, args.head_dim, generator=g, device=dev, dtype=dt) for _ in range(2))
        ex_o, ex_l = pa.partial_attention(q, k, v, causal=causal, left=left, backend="reference")
        out = ex_o.to(dt)
        exact = [ex_o, ex_l, *pb.partial_attention_backward(q, k, v, out, ex_l, dout, causal=causal, left=left,
                                                              backend="reference")]
        got = {b: run(q, k, v, dout, out, ex_l, causal, left, b, args.tiny) for b in ("cudnn", "flash")}
        tile = f"Lq={lq} Lk={lk} causal={causal} left={left}"
        seen = torch.isfinite(ex_l)
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            want = exact[i].float()
            err = {}
            for b, res in got.items():
                x = res[i].float()
                if name == "lse":
                    same_rows = torch.equal(torch.isfinite(x), seen)
                    x, want_i = x[seen], want[seen]
                    err[b] = (x - want_i).abs().max().item() if same_rows else float("inf")
                else:
                    err[b] = (x - want).abs().max().item() if torch.isfinite(x).all() else float("inf")
            floor = 2e-3 if name in ("out", "lse") else 5e-3 * want.abs().max().item()
            ok = err["cudnn"] <= 2 * err["flash"] + floor
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'} {tile} {name}: max|cudnn-exact| {err['cudnn']:.3e}, "
                  f"max|flash-exact| {err['flash']:.3e}")
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
