"""Banded tiles built from square causal calls (megacp.attention.kernels.band) against the banded
reference (the band masked by index), fp32 on CPU: forward out/LSE and backward dq/dk/dv, over
random lengths and bands (one block, several, a short last block, a head whose band is clipped at
key 0, Lq > Lk, queries that see nothing, GQA), causal and not. The causal calls run on the exact
reference, and on the fused kernels' code path (``_kernel_attention`` / ``_kernel_backward``: square
splits, batched ``[B, H, L, D]`` views, KV head groups) with the reference standing in for the kernel."""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from megacp.attention.kernels import partial as pa
from megacp.attention.kernels import partial_backward as pb
from megacp.attention.kernels.band import band_attention, band_backward

SCALE = 0.3


def _rows(x: Tensor) -> Tensor:
    """``[B, H, L, ...]`` → ``[B, L, H, ...]``."""
    return x.transpose(1, 2)


def _kernel_forward(q4: Tensor, k4: Tensor, v4: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """The exact reference with the fused forward kernels' ``[B, H, L, D]`` calling convention
    (top-left causal: only square causal calls are made)."""
    assert not causal or q4.shape[2] == k4.shape[2]
    out, lse = pa._reference_batched(_rows(q4), _rows(k4), _rows(v4), causal=causal, scale=scale)
    return _rows(out), _rows(lse)


def _kernel_grads(dout4: Tensor, q4: Tensor, k4: Tensor, v4: Tensor, out4: Tensor, lse3: Tensor, causal: bool,
                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The exact backward with the fused backward kernels' ``[B, H, L, D]`` calling convention."""
    assert not causal or q4.shape[2] == k4.shape[2]
    grads = [pb.reference_backward(*xs, causal=causal, scale=scale)
             for xs in zip(_rows(q4), _rows(k4), _rows(v4), _rows(out4), _rows(lse3), _rows(dout4))]
    return tuple(_rows(torch.stack(g)) for g in zip(*grads))  # type: ignore[return-value]


def _reference_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    return pa._reference_batched(q, k, v, causal=causal, scale=SCALE)


def _reference_grads(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                     causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    if q.dim() == 3:
        return pb.reference_backward(q, k, v, out, lse, dout, causal=causal, scale=SCALE)
    grads = [pb.reference_backward(*xs, causal=causal, scale=SCALE) for xs in zip(q, k, v, out, lse, dout)]
    return tuple(torch.stack(g) for g in zip(*grads))  # type: ignore[return-value]


def _kernel_attend(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    return pa._kernel_attention(_kernel_forward, q, k, v, causal=causal, scale=SCALE)


def _kernel_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                     causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    return pb._kernel_backward(_kernel_grads, q, k, v, out, lse, dout, causal=causal, scale=SCALE)


def _cases() -> list[tuple[int, int, int, bool]]:
    """(lq, lk, left, causal): chosen shapes (blocks exactly filling the tile, one block, a
    head clipped at key 0, a one-query last block, Lq > Lk, w = 0) then random ones."""
    fixed = [(32, 32, 7, True), (24, 24, 7, True), (8, 8, 7, True), (33, 33, 7, True), (20, 27, 7, True),
             (20, 23, 7, True), (30, 19, 2, True), (17, 17, 0, True), (9, 40, 64, True), (15, 15, 1, True),
             (16, 16, 0, False), (12, 20, 3, False), (20, 12, 3, False), (10, 10, 64, False), (7, 30, 2, False)]
    rnd = random.Random(0)
    for _ in range(25):
        fixed.append((rnd.randint(1, 48), rnd.randint(1, 48), rnd.choice([0, 1, 2, 5, 7, 16, 64]), rnd.random() < 0.6))
    return fixed


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_band_pieces_equal_the_banded_reference(path: str) -> None:
    attend, grads = (_reference_attend, _reference_grads) if path == "reference" else (_kernel_attend, _kernel_backward)
    g = torch.Generator().manual_seed(0)
    for lq, lk, left, causal in _cases():
        q, dout = (torch.randn(lq, 4, 8, generator=g) for _ in range(2))
        k, v = (torch.randn(lk, 2, 8, generator=g) for _ in range(2))
        want, want_lse = pa._reference(q, k, v, causal=causal, scale=SCALE, left=left)
        out, lse = band_attention(q, k, v, causal=causal, left=left, attend=attend)
        case = (lq, lk, left, causal)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), case
        assert torch.allclose(lse, want_lse, atol=1e-5, rtol=1e-5), case
        assert torch.allclose(out, want, atol=1e-5, rtol=1e-5), case
        ref = pb.reference_backward(q, k, v, want, want_lse, dout, causal=causal, scale=SCALE, left=left)
        got = band_backward(q, k, v, want, want_lse, dout, causal=causal, left=left, grads=grads)
        for name, a, b in zip("qkv", got, ref):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (f"d{name}", case)


def test_band_plan_batches_the_full_blocks() -> None:
    """The tiles of a 64K sequence under a 4096-token window (band 4095) at CP 1: 32K queries over
    their own keys (a head of 4096 queries, then 7 blocks of 4096 in one batch), and over a 4095-key
    history (8 blocks, no head); a short last block and a head clipped at key 0."""
    from megacp.attention.kernels.band import _Blocks, _causal_plan

    assert _causal_plan(32768, 32768, 4095) == ((0, 4096, 4096), [_Blocks(4096, 4096, 7, 4096, 4095, 4095)])
    assert _causal_plan(32768, 32768 + 4095, 4095) == (None, [_Blocks(0, 4095, 8, 4096, 4095, 4095)])
    assert _causal_plan(10, 13, 4) == ((0, 2, 5), [_Blocks(2, 5, 1, 5, 4, 4), _Blocks(7, 10, 1, 3, 3, 4)])
