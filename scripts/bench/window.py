#!/usr/bin/env python3
"""Sliding-window against full causal attention on one device, through megacp's training path:
how much of the work outside the window the tile planner really skips.

    python -m scripts.bench.window --json out/window.json             # one GPU: 64K tokens, 4K window
    python -m scripts.bench.window --tiny --json /tmp/window.json      # CPU smoke test (seconds)

Banded tiles (every tile of this plan) run as cuDNN's own band where the cuDNN frontend package is
installed (:mod:`megacp.attention.kernels.cudnn_band`), else as batched square causal cuDNN calls
(:mod:`megacp.attention.kernels.band`) (``window`` rows, backend ``"auto"``) and, with ``--band-kernels
auto,flash`` (the default on CUDA), also through FlashAttention-2's window arguments
(``window_flash`` rows, backend ``"flash"``), in the same run. The kernel that served the
``"auto"`` rows' banded tiles is printed (``band kernel: cudnn``, or ``flash`` where cuDNN refused).

Shape: 32 Q / 8 KV heads, head dim 128, bf16, batch 1, ``[S, H, D]`` tensors (``--tiny``: 256
tokens, a 32-token window, 4 / 2 heads of 16, fp32 on CPU). Rows, each timed alone
(:func:`scripts.bench.harness.measure`):

* ``full`` / ``window`` at ``cp1``: :func:`megacp.attention.ring_attention` at CP 1 with the plan
  ``ShardPlan([0], [S], 1, 0)`` and the same plan ``.with_window(W)``; ``fwd`` under ``no_grad``,
  ``fwd_bwd`` forward and the fused backward.
* ``full`` / ``window`` at ``cp2_rank{0,1}`` (``fwd_bwd``): what each CP 2 rank computes with no
  communication: its queries over both ranks' blocks through the ring's tiles
  (:func:`scripts.bench.train_attention.rank_work`); a rank's time is its share of the work.
* ``flash_full`` (CUDA only): SDPA FlashAttention-2, full causal: ``window_flash`` against it is the
  skipping at equal kernel efficiency (FlashAttention-2's).

The ratio ``full / window`` (target: at least 8x at 64K with a 4K window on one H200) is printed
with the work ratio of the two masks (causal pairs over windowed pairs: 8.26 at 64K / 4K), which
bounds it when both run equally efficient kernels.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch
from torch.nn.attention import SDPBackend

from megacp.attention import ring_attention
from megacp.attention.kernels import partial, partial_backward
from megacp.placement import ShardPlan
from scripts.bench import harness as bh
from scripts.bench.train_attention import fwd_bwd, rank_work, sdpa

TARGET = 8.0
"""The speed-up the window must reach over full causal attention (64K tokens, 4K window)."""


def pairs(s: int, window: int | None) -> int:
    """(query, key) pairs a causal mask over ``s`` tokens lets through, under ``window`` keys."""
    if window is None or window >= s:
        return s * (s + 1) // 2
    return s * window - window * (window - 1) // 2


def forward_only(f: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> Callable[[], None]:
    """A call that runs ``f(*inputs)`` without autograd."""
    def run() -> None:
        with torch.no_grad():
            f(*inputs)
    return run


def band_kernel_used(cuda: bool) -> str:
    """The kernel that served banded tiles under ``"auto"`` in this process: ``cudnn``, ``flash``
    where cuDNN refused a band's shape (forward or backward), ``reference`` off CUDA."""
    if not cuda:
        return "reference"
    refused = [key for key in (*partial._refused, *partial_backward._refused) if key[0] == "cudnn" and "band" in key]
    return f"flash (cuDNN refused {refused})" if refused else "cudnn"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seq-len", type=bh.parse_sizes, default=bh.parse_sizes("64K"), help="one size")
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--target-s", type=float, default=1.0, help="seconds of timed calls per row")
    p.add_argument("--tiny", action="store_true", help="CPU, fp32, 256 tokens, window 32, 4 / 2 heads of 16")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--band-kernels", default=None,
                   help="backends the window rows run under, comma-separated: auto (cuDNN band), flash (FA2 window); "
                        "default auto,flash on CUDA, auto on CPU")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.window, args.heads, args.kv_heads, args.head_dim = [256], 32, 4, 2, 16
        args.target_s = 0.0
    elif not torch.cuda.is_available():
        print("error: the window benchmark times GPU kernels; --tiny runs it on CPU", file=sys.stderr)
        return 2
    s, w = args.seq_len[0], args.window
    if not 1 <= w < s:
        print(f"error: --window must be in [1, {s}), got {w}", file=sys.stderr)
        return 2
    kernels = (args.band_kernels or ("auto" if args.tiny else "auto,flash")).split(",")
    if any(kn not in ("auto", "flash") for kn in kernels) or "auto" not in kernels:
        print(f"error: --band-kernels takes auto and optionally flash, got {args.band_kernels!r}", file=sys.stderr)
        return 2
    ctx = bh.init("cpu" if args.tiny else "cuda", "fp32" if args.tiny else "bf16")
    rep = bh.Report(ctx, args.json, {**bh.env_info(ctx), "kind": "window", "argv": sys.argv, "seqlen": s, "window": w,
                                     "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim})
    g = torch.Generator(device=ctx.device).manual_seed(args.seed)
    q, k, v, dout = (torch.randn(s, h, args.head_dim, generator=g, device=ctx.device, dtype=ctx.dtype)
                     for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    rows: list[dict] = []

    def time(mask: str, layout: str, kind: str, fn: Callable[[], None]) -> None:
        tm = bh.measure(ctx, fn, collective=False, target_s=args.target_s)
        row = {"mask": mask, "layout": layout, "pass": kind, "ms": tm.ms, **tm.as_dict()}
        rep.result(row)
        rows.append(row)

    variants = [("full", None, "auto")] + [("window" if kn == "auto" else f"window_{kn}", w, kn) for kn in kernels]
    for mask, window, backend in variants:
        plan = ShardPlan([0], [s], 1, 0).with_window(window)
        attend = lambda a, b, c, plan=plan, backend=backend: ring_attention(a, b, c, plan, None, backend=backend)  # noqa: E731
        time(mask, "cp1", "fwd", forward_only(attend, [q, k, v]))
        time(mask, "cp1", "fwd_bwd", fwd_bwd(attend, [q, k, v], dout))
        plans = [ShardPlan([0], [s], 2, r).with_window(window) for r in range(2)]
        idx = [pl.local_index().to(ctx.device) for pl in plans]
        for r in range(2):
            time(mask, f"cp2_rank{r}", "fwd_bwd",
                 rank_work(q.detach(), k.detach(), v.detach(), dout, plans[r], idx, backend=backend))
        if mask == "window":
            band = band_kernel_used(ctx.cuda)
            rep.data["band_kernel"] = band
            print(f"band kernel: {band}")
    if ctx.cuda:
        flash = sdpa(SDPBackend.FLASH_ATTENTION)
        time("flash_full", "cp1", "fwd", forward_only(flash, [q, k, v]))
        time("flash_full", "cp1", "fwd_bwd", fwd_bwd(flash, [q, k, v], dout))
    ms = {(r["mask"], r["layout"], r["pass"]): r["ms"] for r in rows}
    windows = [mask for mask, _, _ in variants[1:]]
    for mask in ("full", *windows):  # CP 2 runs at the pace of its slower rank
        ms[(mask, "cp2_slowest", "fwd_bwd")] = max(ms[(mask, f"cp2_rank{r}", "fwd_bwd")] for r in range(2))
    work = pairs(s, None) / pairs(s, w)
    ratios = []
    for mask in windows:
        for layout, kind in (("cp1", "fwd"), ("cp1", "fwd_bwd"), ("cp2_slowest", "fwd_bwd")):
            full, windowed = ms[("full", layout, kind)], ms[(mask, layout, kind)]
            flash_ms = ms.get(("flash_full", layout, kind))
            row = {"window": mask, "layout": layout, "pass": kind, "full_ms": full, "window_ms": windowed,
                   "speedup": full / windowed, "work_ratio": work,
                   "vs_flash_full": None if flash_ms is None else flash_ms / windowed}
            row["meets_target"] = row["speedup"] >= TARGET
            rep.result({"method": "ratio", **row})
            ratios.append(row)
    bh.print_table(ctx, rows, [("mask", "mask", "s"), ("layout", "layout", "s"), ("pass", "pass", "s"),
                               ("ms", "ms", ".3f")], f"S={bh.size_label(s)}, window {w}")
    bh.print_table(ctx, ratios, [("window", "window", "s"), ("layout", "layout", "s"), ("pass", "pass", "s"), ("full_ms", "full ms", ".3f"),
                                 ("window_ms", "window ms", ".3f"), ("speedup", "full/window", ".2f"),
                                 ("work_ratio", "pairs ratio", ".2f"), ("vs_flash_full", "flash full/window", ".2f"),
                                 ("meets_target", f">= {TARGET:g}x", "s")], "speed-up of the window")
    rep.data["ratios"] = ratios
    rep.save()
    bh.finish(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
