"""Which token rows of a sequence each rank holds in the peers' layouts (pure index math)."""

from __future__ import annotations

import torch


def load_balanced_index(s: int, n: int, r: int) -> torch.Tensor:
    """Rows of rank ``r`` of ``n`` in the 2N-chunk load-balanced layout (chunks r and 2N-1-r of
    ``s // (2n)`` tokens): Transformer Engine's layout, and megacp's for one whole sequence."""
    c = s // (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])


def contiguous_index(s: int, n: int, r: int) -> torch.Tensor:
    """Rows of rank ``r`` of ``n`` in contiguous shards of ``s // n`` tokens (DeepSpeed-Ulysses)."""
    c = s // n
    return torch.arange(r * c, (r + 1) * c)
