"""The cuDNN band call of a banded tile (:class:`megacp.attention.kernels.cudnn_band.Band`): the
``TOP_LEFT`` diagonal band cuDNN is given, on the rows and keys it is given, must show each query
exactly the keys of megacp's bottom-right band (:func:`megacp.attention.kernels.partial.hidden_by_band`),
checked pair by pair."""

from __future__ import annotations

import itertools

import pytest
import torch

from megacp.attention.kernels.cudnn_band import Band
from megacp.attention.kernels.partial import hidden_by_band


def cudnn_visible(lq: int, lk: int, band: Band | None) -> torch.Tensor:
    """``[lq, lk]`` bool: the pairs cuDNN's call attends (cuDNN's documented band semantics:
    key ``j'`` is seen by query ``i'`` iff ``i' - left < j' <= i' + right``)."""
    seen = torch.zeros(lq, lk, dtype=torch.bool)
    if band is None:
        return seen
    i = torch.arange(lq - band.r0).unsqueeze(1)
    j = torch.arange(lk - band.s0).unsqueeze(0)
    inside = j > i - band.left
    if band.right is not None:
        inside &= j <= i + band.right
    seen[band.r0:, band.s0:] = inside
    return seen


@pytest.mark.parametrize("causal", [True, False])
def test_band_call_shows_exactly_the_window(causal: bool) -> None:
    for lq, lk, left in itertools.product([1, 2, 5, 16, 33], [1, 3, 16, 40], [0, 1, 4, 15, 64]):
        band = Band.of(lq, lk, causal=causal, left=left)
        want = ~hidden_by_band(0, lq, 0, lk, lk - lq, left, torch.device("cpu"))
        if causal:
            want &= torch.arange(lk).unsqueeze(0) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
        assert torch.equal(cudnn_visible(lq, lk, band), want), (lq, lk, left, band)
        if band is not None:  # the backward's call: dummy rows first, the same pairs after them
            pad, call = band.aligned()
            assert call.right in (0, None) and (pad == 0 or causal)
            padded = cudnn_visible(lq + pad, lk, Band(band.r0, call.s0, call.right, call.left))
            assert torch.equal(padded[pad:], want), (lq, lk, left, band, call)
        if band is not None:
            assert band.left >= 1 and (band.right is None or band.right >= 0)
            assert band.r0 < lq and band.s0 < lk


def test_band_call_trims_rows_and_keys() -> None:
    # 4 queries after 6 keys (offset 6), window of 2 keys before the diagonal: keys 4.. are used
    assert Band.of(4, 10, causal=True, left=2) == Band(r0=0, s0=4, right=2, left=1)
    # more queries than keys: the first 3 see nothing and are not given to cuDNN
    assert Band.of(8, 5, causal=True, left=1) == Band(r0=3, s0=0, right=0, left=2)
    assert Band.of(3, 2, causal=True, left=0) == Band(r0=1, s0=0, right=0, left=1)
