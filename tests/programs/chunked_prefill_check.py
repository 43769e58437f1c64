"""Chunked prefill against whole-prompt prefill on one GPU, and what each chunk allocates.

    python tests/programs/chunked_prefill_check.py                         # Llama-3.1-8B shape, 4 layers, 64K tokens
    python tests/programs/chunked_prefill_check.py --device cpu --tiny     # the same logic on CPU, fp32

One random prompt (``--tokens``) through a megacp model of random weights (bf16 on CUDA), prefilled
whole and in chunks of ``--chunk`` tokens (each later chunk attends over its cached prefix through a
view of the cache, the fused kernels' prefix and causal parts merged in place): the last token's
logits of the two must agree within bf16 noise (relative L2 error below 2e-2; fp32: 1e-4) with the
same argmax. Prints each run's time, the peak memory it allocated beyond the weights and the cache
(``torch.cuda.max_memory_allocated``), and the automatic chunk of this GPU; exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

import megacp
from megacp.generate import Generator
from megacp.layers.settings import CPSettings
from megacp.models import build_model
from megacp.models.config import ModelConfig
from scripts.bench import harness as bh
from scripts.perf_model import LLAMA3_8B

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   max_position_embeddings=1 << 20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer shape of width 64")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=bh.parse_sizes, default=None, help="prompt length (default 64K; --tiny: 600)")
    p.add_argument("--chunk", type=int, default=None, help="chunk (default 16384; --tiny: 128)")
    args = p.parse_args(argv)
    ctx = bh.init(args.device, None)
    cfg = TINY if args.tiny else dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
    tokens = (args.tokens or [600 if args.tiny else 65536])[0]
    chunk = args.chunk or (128 if args.tiny else 16384)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=ctx.dtype, device=ctx.device, backend="torch")
    settings = CPSettings.from_state(ctx.state)
    megacp.swap_attention(model, settings)
    auto = Generator.for_model(model, cfg, settings, device=ctx.device, dtype=ctx.dtype)
    print(f"automatic prefill chunk: {auto.prefill_chunk or 'whole prompt'}", flush=True)
    prompt = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    last = {}
    for size in (tokens, chunk):
        gen = Generator.for_model(model, cfg, settings, device=ctx.device, dtype=ctx.dtype, prefill_chunk=size)
        cache, slots = gen.batch_cache([prompt], 1)
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if ctx.cuda else 0
        t = time.perf_counter()
        with torch.inference_mode():
            logits, steps = gen.prefill(cache, slots, [prompt])
        bh.sync(ctx)
        peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB" if ctx.cuda else "n/a (CPU)"
        print(f"chunk {size}: {len(steps)} steps, {time.perf_counter() - t:.2f} s, allocated beyond weights and "
              f"cache {peak}, cache {2 * cache.k.nbytes / 2**30:.2f} GiB", flush=True)
        last[size] = logits.float()
        del cache
    whole, parts = last[tokens], last[chunk]
    err = float((whole - parts).norm() / whole.norm())
    ok = err < (2e-2 if ctx.dtype != torch.float32 else 1e-4) and bool((whole.argmax(-1) == parts.argmax(-1)).all())
    print(f"{'PASS' if ok else 'FAIL'} chunked vs whole: relative L2 error {err:.2e}, same argmax "
          f"{bool((whole.argmax(-1) == parts.argmax(-1)).all())}", flush=True)
    bh.finish(ctx)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
