#!/usr/bin/env python3
"""How fast cuDNN runs one CP rank's pass-KV work when it is cut into kernel calls differently (1 GPU).

    python3 -m scripts.diagnostics.probe_kernel_shapes --seqlens 16K,64K,128K

With N = 2 and the 2N-chunk layout (chunk c = S/4 tokens), rank 0 holds query/key chunks (0, 3)
and receives (1, 2); rank 1 holds (1, 2) and receives (0, 3). Each rank's work is 4 c² causal
units; this times several cuts of it on one GPU (every call on random data, variants round-robin so
clock and power drift hit them alike), in two memory layouts:

* ``thd`` — tokens first ``[L, H, D]`` (what megacp's ring hands the kernels), viewed as ``[1, H, L, D]``;
* ``hm``  — head-major ``[H, L, D]`` contiguous (what cuDNN writes its output in);

and the single-GPU causal call over all S tokens (T1) in both layouts. Cuts:

* ``base``  — one causal call over the 2 local chunks + one dense call for the received block
  (what :func:`megacp.attention.pass_kv.ring_pass_kv` runs);
* ``b2``    — the local chunks as a batch of two causal sequences + the dense cross-chunk block as
  its own call + the received dense block;
* ``cat``   — ``b2`` with the dense calls joined into one over a buffer holding the needed chunks
  next to each other (the copy that would build it is not timed).

Prints ms, efficiency T1/(2·t) against T1 in the ``thd`` layout, mean SM clock and power.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from scripts.bench import harness as bh


def attn(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, causal: bool) -> torch.Tensor:
    """One cuDNN call on ``[B, H, L, D]`` views (any strides, unit last stride)."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False)[0]


class Layout:
    """Tensors of one layout and views ``[B, H, L, D]`` of row ranges of them."""

    def __init__(self, name: str, rows: int, heads: int, d: int, device: torch.device) -> None:
        self.name = name
        shape = (rows, heads, d) if name == "thd" else (heads, rows, d)
        self.t = torch.randn(shape, device=device, dtype=torch.bfloat16)

    def view(self, a: int, b: int, batches: int = 1) -> torch.Tensor:
        """Rows ``[a, b)`` as ``[batches, H, (b-a)/batches, D]``."""
        if self.name == "thd":
            x = self.t[a:b]
            return x.view(batches, (b - a) // batches, *x.shape[1:]).transpose(1, 2)
        x = self.t[:, a:b]
        return x.view(x.shape[0], batches, (b - a) // batches, x.shape[-1]).transpose(0, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default="16K,64K,128K")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    h, hkv, d = 32, 8, 128
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for s in bh.parse_sizes(args.seqlens):
        c = s // 4
        fns: dict[str, Callable[[], object]] = {}
        keep = []
        for lay in ("thd", "hm"):
            qf, kf, vf = (Layout(lay, s, hh, d, dev) for hh in (h, hkv, hkv))  # the whole sequence
            keep += [qf, kf, vf]
            fns[f"T1 {lay}"] = lambda qf=qf, kf=kf, vf=vf: attn(qf.view(0, s), kf.view(0, s), vf.view(0, s), True)
            # local buffers: 2c query rows; local keys (2c); received block (2c); a joined buffer (3c)
            q, kl, vl, kr, vr, kc, vc = (Layout(lay, n, hh, d, dev) for n, hh in
                                         ((2 * c, h), (2 * c, hkv), (2 * c, hkv), (2 * c, hkv), (2 * c, hkv),
                                          (3 * c, hkv), (3 * c, hkv)))
            keep += [q, kl, vl, kr, vr, kc, vc]

            def base0(q=q, kl=kl, vl=vl, kr=kr, vr=vr):
                attn(q.view(0, 2 * c), kl.view(0, 2 * c), vl.view(0, 2 * c), True)
                attn(q.view(c, 2 * c), kr.view(0, 2 * c), vr.view(0, 2 * c), False)

            def b2_0(q=q, kl=kl, vl=vl, kr=kr, vr=vr):
                attn(q.view(0, 2 * c, 2), kl.view(0, 2 * c, 2), vl.view(0, 2 * c, 2), True)
                attn(q.view(c, 2 * c), kl.view(0, c), vl.view(0, c), False)
                attn(q.view(c, 2 * c), kr.view(0, 2 * c), vr.view(0, 2 * c), False)

            def cat0(q=q, kl=kl, vl=vl, kc=kc, vc=vc):
                attn(q.view(0, 2 * c, 2), kl.view(0, 2 * c, 2), vl.view(0, 2 * c, 2), True)
                attn(q.view(c, 2 * c), kc.view(0, 3 * c), vc.view(0, 3 * c), False)

            def base1(q=q, kl=kl, vl=vl, kr=kr, vr=vr):
                attn(q.view(0, 2 * c), kl.view(0, 2 * c), vl.view(0, 2 * c), True)
                attn(q.view(0, 2 * c), kr.view(0, c), vr.view(0, c), False)

            def b2_1(q=q, kl=kl, vl=vl, kr=kr, vr=vr):
                attn(q.view(0, 2 * c, 2), kl.view(0, 2 * c, 2), vl.view(0, 2 * c, 2), True)
                attn(q.view(c, 2 * c), kl.view(0, c), vl.view(0, c), False)
                attn(q.view(0, 2 * c), kr.view(0, c), vr.view(0, c), False)

            def cat1(q=q, kl=kl, vl=vl, kr=kr, vr=vr, kc=kc, vc=vc):
                attn(q.view(0, 2 * c, 2), kl.view(0, 2 * c, 2), vl.view(0, 2 * c, 2), True)
                attn(q.view(c, 2 * c), kc.view(0, 2 * c), vc.view(0, 2 * c), False)
                attn(q.view(0, c), kr.view(0, c), vr.view(0, c), False)

            for name, fn in (("base", base0), ("b2", b2_0), ("cat", cat0)):
                fns[f"rank0 {name} {lay}"] = fn
            for name, fn in (("base", base1), ("b2", b2_1), ("cat", cat1)):
                fns[f"rank1 {name} {lay}"] = fn
        samplers = {k: bh.Sampler() for k in fns}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for fn in fns.values():
            fn()
        calls = max(1, min(20, int(2000 / (s / 1024) ** 2)))
        for _ in range(args.reps):
            for k, fn in fns.items():
                torch.cuda.synchronize()
                with samplers[k]:
                    times[k].append(bh.window_ms(fn, calls if not k.startswith("T1") else max(1, calls // 2)))
        t1 = statistics.median(times["T1 thd"])
        print(f"\n=== S={bh.size_label(s)} (c = {c}; T1 thd = {t1:.3f} ms)")
        for k, v in times.items():
            ms = statistics.median(v)
            smp = samplers[k]
            eff = "" if k.startswith("T1") else f"eff {t1 / (2 * ms):.3f}"
            clk = f"{smp.clock:6.0f} MHz {smp.power:5.0f} W" if smp.clock else ""
            print(f"  {k:18s} {ms:9.3f} ms  spread {(max(v) - min(v)) / ms * 100:4.1f}%  {eff:10s} {clk}", flush=True)
        del keep, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
