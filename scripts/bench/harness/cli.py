"""Command-line pieces shared by the benchmarks: size lists, name lists, the common options."""

from __future__ import annotations

import argparse

import torch

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
          "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}
"""``--dtype`` names."""


def parse_sizes(text: str) -> list[int]:
    """``"16384,64K,1M"`` → ``[16384, 65536, 1048576]`` (K = 1024, M = 1024²).

    Raises:
        ValueError: a token is not an integer with an optional K/M suffix.
    """
    out = []
    for tok in text.split(","):
        tok = tok.strip().upper()
        if not tok:
            continue
        mult = {"K": 1024, "M": 1024 ** 2}.get(tok[-1], 1)
        digits = tok[:-1] if mult > 1 else tok
        if not digits.isdigit():
            raise ValueError(f"size {tok!r} is not an integer with an optional K or M suffix")
        out.append(int(digits) * mult)
    return out


def parse_names(text: str) -> list[str]:
    """``"a, b,,c"`` → ``["a", "b", "c"]``."""
    return [t.strip() for t in text.split(",") if t.strip()]


def size_label(n: int) -> str:
    """``65536`` → ``"64K"``, ``1048576`` → ``"1M"``, other numbers as they are."""
    if n % (1024 ** 2) == 0:
        return f"{n // 1024 ** 2}M"
    if n % 1024 == 0:
        return f"{n // 1024}K"
    return str(n)


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Options every attention benchmark takes: device, dtype, attention shape, seed, JSON path."""
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (NCCL) or cpu (gloo, for smoke tests; kernels become the reference path)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="write the results as JSON to this path (rank 0)")
