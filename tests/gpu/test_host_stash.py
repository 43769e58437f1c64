"""Checkpointed layer inputs in host memory on a CUDA GPU (skips without one: the CI machine): each
buffer of a :class:`~megacp.models.checkpointing.HostStash` is page-locked and exactly its input's
size (torch's caching host allocator would hold a power of two), the inputs come back bit-exact
through the side stream, the buffers are reused across steps, a checkpointed layer's gradients equal
those with its input kept on the GPU, and the pages are unlocked when the stash is collected."""

from __future__ import annotations

import gc

import pytest
import torch

from megacp.models.checkpointing import HostStash, checkpoint_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_exact_size_pinned_buffers_round_trip_and_unlock() -> None:
    device = torch.device("cuda")
    stash = HostStash(device)
    xs = [torch.randn(3 * 1000 + 7, 96, device=device, dtype=torch.bfloat16) for _ in range(3)]  # 5.5 pages each
    for _step in range(2):
        stash.begin()
        indices = [stash.put(x) for x in xs]
        hosts = [e.host for e in stash._entries if e is not None]
        assert all(h.is_pinned() and h.untyped_storage().nbytes() == x.numel() * 2 for h, x in zip(hosts, xs))
        assert stash.bytes_offloaded == sum(x.numel() * 2 for x in xs)
        for i in reversed(indices):  # backward order: each fetch starts copying the one before back
            assert torch.equal(stash.fetch(i), xs[i])
    assert len(stash._locked) == 3  # the second step reused the first step's buffers
    kept = stash._locked[0]
    del stash
    gc.collect()
    assert not kept.is_pinned()  # unlocked on collection (this reference keeps the memory mapped)


def test_offloaded_checkpoint_gradients_equal_kept_ones() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device)
    x0 = torch.randn(4096 + 5, 64, device=device)
    grads = []
    for stash in (None, HostStash(device)):
        layer.zero_grad()
        if stash is not None:
            stash.begin()
        x = x0.clone().requires_grad_(True)
        y = checkpoint_layer(lambda h: h + layer(h), checkpoint_layer(lambda h: h + layer(h), x, stash), stash)
        y.square().sum().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in layer.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
