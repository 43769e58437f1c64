#!/usr/bin/env python3
"""How fast the fused attention backward runs the dense tile of a CP = 2 rank, cut differently (1 GPU).

    python3 -m scripts.diagnostics.probe_backward_shapes --seqlens 16K,32K

With N = 2 and the 2N-chunk layout (chunk c = S/4 tokens), rank 0's dense tile is one query chunk
over the two chunks of rank 1's block (``c × 2c``), rank 1's is its two query chunks over the first
chunk of rank 0's block (``2c × c``): the same FLOPs in shapes the kernels run differently. This
times the backward (``aten._scaled_dot_product_{cudnn,flash}_attention_backward`` on ``[L, H, D]``
tensors, the ring's layout) of:

* ``c×2c`` — rank 0's tile (the bound's shape);
* ``2c×c`` — rank 1's tile in one call;
* ``2c×c split`` — two ``c × c`` calls (dK/dV of the second added to the first's);
* ``2c×c batch`` — one call with the two query chunks as a batch of two over the same keys (dK/dV
  summed over the batch).

Variants run round-robin so clock and power drift hit them alike. Prints median ms and the ratio to
``c×2c``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from megacp.attention.kernels import registry
from megacp.attention.kernels.partial import kernel_module
from scripts.bench import harness as bh


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="16K,32K")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    h, hkv, d, scale = 32, 8, 128, 128 ** -0.5
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")

    def t(n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, d, device=dev, dtype=torch.bfloat16)

    def v4(x: torch.Tensor, b: int = 1) -> torch.Tensor:  # [L, H, D] -> [b, H, L/b, D]
        return x.view(b, x.shape[0] // b, *x.shape[1:]).transpose(1, 2)

    for s in bh.parse_sizes(args.seqlens):
        c = s // 4
        q, o, do = t(2 * c, h), t(2 * c, h), t(2 * c, h)
        k, v = t(2 * c, hkv), t(2 * c, hkv)
        lse = torch.randn(2 * c, h, device=dev, dtype=torch.float32).add_(8.0)
        fns: dict[str, Callable[[], object]] = {}
        for name, kern in ((b.name, kernel_module(b.name).backward) for b in registry.fused()):
            def call(qa: int, qb: int, kb: int, b: int = 1, kern=kern) -> tuple:
                kk, vv = k[:kb], v[:kb]
                if b > 1:  # the same keys for every batch entry
                    kk, vv = (x.unsqueeze(0).expand(b, *x.shape).reshape(b * kb, *x.shape[1:]) for x in (kk, vv))
                l3 = lse[qa:qb].t().contiguous().view(h, b, (qb - qa) // b).transpose(0, 1).contiguous()
                return kern(v4(do[qa:qb], b), v4(q[qa:qb], b), v4(kk, b), v4(vv, b), v4(o[qa:qb], b), l3, False, scale)

            def split(call=call) -> None:
                _, dk, dv = call(0, c, c)
                _, dk2, dv2 = call(c, 2 * c, c)
                dk.add_(dk2), dv.add_(dv2)

            def batch(call=call) -> None:
                _, dk, dv = call(0, 2 * c, c, 2)
                dk.sum(0), dv.sum(0)

            fns[f"{name} c×2c"] = lambda call=call: call(0, c, 2 * c)
            fns[f"{name} 2c×c"] = lambda call=call: call(0, 2 * c, c)
            fns[f"{name} 2c×c split"] = split
            fns[f"{name} 2c×c batch"] = batch
        times: dict[str, list[float]] = {key: [] for key in fns}
        for fn in fns.values():
            fn()
        calls = max(2, min(40, int(4000 / (s / 1024) ** 2)))
        for _ in range(args.reps):
            for key, fn in fns.items():
                torch.cuda.synchronize()
                times[key].append(bh.window_ms(fn, calls))
        print(f"\n=== S={bh.size_label(s)} (c = {c})")
        for key, val in times.items():
            ref = statistics.median(times[key.split()[0] + " c×2c"])
            ms = statistics.median(val)
            print(f"  {key:22s} {ms:8.3f} ms  spread {(max(val) - min(val)) / ms * 100:4.1f}%  ×{ms / ref:.3f}", flush=True)
        del q, o, do, k, v, lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
