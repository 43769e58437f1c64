"""Activation checkpointing of decoder layers, with the checkpointed inputs optionally kept in host
memory between the forward and the backward.

A checkpointed layer keeps only its input ``x [T, H]`` (Llama-3.1-8B shape, bf16: 8 KiB per token and
layer, 256 KiB per token for 32 layers) and runs its forward again in backward. :func:`checkpoint_layer`
is a reentrant-style autograd function: the forward runs without autograd; the backward recomputes the
layer under autograd from the saved input and back-propagates through it
(:func:`torch.autograd.backward`, so parameter gradients accumulate as usual and a training engine's
gradient hooks fire). The recompute runs the layer's collectives (CP ring, TP all-reduces) again, in
the same order on every rank. megacp's layers hold no dropout, so no RNG state is replayed.

With a :class:`HostStash` the input goes to pinned host memory instead: copied on a side CUDA
stream right after the layer's forward (overlapped with the next layer's compute), and copied back
on that stream when the backward of the *following* layer starts (overlapped with that layer's
recompute and backward), so that at most two offloaded inputs are on the GPU at once. Each host
buffer holds exactly its input's bytes (:func:`page_locked_empty`: whole pages of its own, locked with
``cudaHostRegister``, where torch's caching host allocator would round it up to a power of two); the
buffers are pooled by shape, reused across steps, and unlocked and freed when the stash is. On CPU the
stash holds plain copies (tests).

:func:`checkpoint_block` makes several layers one checkpoint (a second level: one kept input per block,
the block's layers checkpointed again while its backward runs).
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the locked pages count as pinned memory in every CUDA context of the
process, not only the current device's."""


def page_locked_empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialised host tensor of ``shape`` and ``dtype`` in page-locked (pinned) memory of
    exactly its size: an anonymous mapping of its own (``ceil(bytes / page)`` pages, shared with no
    other allocation) locked with ``cudaHostRegister``, so that copies to and from CUDA devices run
    asynchronously. Release it with :func:`page_unlock` before the tensor is freed.

    Raises:
        RuntimeError: CUDA refuses to lock the pages (its error code in the message).
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # unmapped once the tensor's storage is freed
    host = torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(tuple(shape))
    err = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte host buffer failed with cudaError {err}")
    return host


def page_unlock(buffers: list[Tensor], stream: torch.cuda.Stream | None) -> None:
    """Unlock the pages of the :func:`page_locked_empty` tensors ``buffers`` once ``stream``'s copies
    have finished, and drop them (their memory is unmapped when nothing else holds them)."""
    if stream is not None:
        stream.synchronize()
    for host in buffers:
        if host.numel():
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())  # a failure leaves pages locked until exit
    buffers.clear()


@dataclass
class _Entry:
    """One offloaded input: its host copy, the device copy once fetched, and the copy's event."""

    host: Tensor
    device: torch.device
    event: Any = None  # torch.cuda.Event of the last copy issued for this entry
    fetched: Tensor | None = None


class HostStash:
    """Checkpointed layer inputs parked in (pinned) host memory for one step at a time.

    Args:
        device: the device the layers run on.

    Attributes:
        bytes_offloaded: host bytes the current step's inputs occupy (for reports).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[Tensor]] = {}
        self._entries: list[_Entry | None] = []  # None once fetched (its buffer is back in the pool)
        self.bytes_offloaded = 0
        self._locked: list[Tensor] = []  # every page-locked buffer, unlocked when the stash is collected
        if self.cuda:
            weakref.finalize(self, page_unlock, self._locked, self.stream)

    def begin(self) -> None:
        """Start a step: buffers of entries a previous step left unfetched return to the pool."""
        for entry in self._entries:
            if entry is not None:
                self._release(entry)
        self._entries = []
        self.bytes_offloaded = 0

    def put(self, x: Tensor) -> int:
        """Copy ``x`` to host memory (asynchronously on CUDA); returns the entry's index."""
        key = (tuple(x.shape), x.dtype)
        pool = self._free.get(key)
        if pool:
            host = pool.pop()
        elif self.cuda:
            host = page_locked_empty(x.shape, x.dtype)
            self._locked.append(host)
        else:
            host = torch.empty(x.shape, dtype=x.dtype)
        entry = _Entry(host, x.device)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(x, non_blocking=True)
                entry.event = torch.cuda.Event()
                entry.event.record(self.stream)
            x.record_stream(self.stream)  # x's memory is not reused before the copy has read it
        else:
            host.copy_(x)
        self._entries.append(entry)
        self.bytes_offloaded += host.numel() * host.element_size()
        return len(self._entries) - 1

    def _prefetch(self, entry: _Entry) -> None:
        if entry.fetched is not None:
            return
        if self.stream is None:
            entry.fetched = entry.host.clone()
            return
        current = torch.cuda.current_stream(self.device)
        dev = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=entry.device)
        self.stream.wait_stream(current)  # dev's memory may have been freed by work queued there
        with torch.cuda.stream(self.stream):
            dev.copy_(entry.host, non_blocking=True)
            entry.event = torch.cuda.Event()
            entry.event.record(self.stream)
        entry.fetched = dev

    def fetch(self, index: int) -> Tensor:
        """The input of entry ``index`` back on its device (ready on the current stream); starts
        copying entry ``index - 1`` back as well, for the layer whose backward comes next."""
        entry = self._entries[index]
        if entry is None:
            raise RuntimeError(f"checkpointed layer input {index} was already fetched (a second backward needs "
                               "retain_graph, which offloaded checkpoints do not support)")
        self._prefetch(entry)
        previous = self._entries[index - 1] if index > 0 else None
        if previous is not None:
            self._prefetch(previous)
        x = entry.fetched
        assert x is not None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.event)
        self._release(entry)
        self._entries[index] = None
        return x

    def _release(self, entry: _Entry) -> None:
        # the host buffer's next use is a copy on the same side stream, ordered after this one
        self._free.setdefault((tuple(entry.host.shape), entry.host.dtype), []).append(entry.host)
        entry.fetched = None


def keep_input(ctx: Any, x: Tensor, stash: HostStash | None) -> None:
    """Keep a checkpoint's input ``x`` for its backward in an autograd function's ``ctx``: on the
    device, or in ``stash``'s host memory (:func:`kept_input` gets it back)."""
    ctx.stash = stash
    if stash is None:
        ctx.save_for_backward(x)
    else:
        ctx.index = stash.put(x)


def kept_input(ctx: Any) -> Tensor:
    """The input :func:`keep_input` kept (fetched back from the host stash, if there)."""
    return ctx.saved_tensors[0] if ctx.stash is None else ctx.stash.fetch(ctx.index)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor | None, run: Callable[[Tensor], Tensor],
                stash: HostStash | None) -> Tensor:
        with torch.no_grad():
            y = run(x)
        ctx.run = run
        keep_input(ctx, x, stash)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None, None]:
        x = kept_input(ctx)
        with torch.enable_grad():
            xd = x.detach().requires_grad_(ctx.needs_input_grad[0])
            y = ctx.run(xd)
        torch.autograd.backward(y, dy)
        return (xd.grad if ctx.needs_input_grad[0] else None), None, None, None


class SelfCheckpointed:
    """A layer run that keeps only its input for the backward by itself (a layer trained over query
    tiles, :func:`~megacp.models.tiled_layer.tiled_layer`): :func:`checkpoint_layer` hands it the
    stash instead of wrapping it in a second checkpoint.

    Args:
        run: ``(x, stash) -> y``, keeping ``x`` (in ``stash`` when given) for its own backward.
    """

    def __init__(self, run: Callable[[Tensor, HostStash | None], Tensor]) -> None:
        self.run = run

    def __call__(self, x: Tensor) -> Tensor:
        return self.run(x, None)


def checkpoint_layer(run: Callable[[Tensor], Tensor], x: Tensor, stash: HostStash | None = None) -> Tensor:
    """``run(x)`` keeping only ``x`` (on the device, or in ``stash``) for the backward, which
    recomputes ``run`` under autograd.

    Args:
        run: the layer, ``[T, H] -> [T, H]`` (its other inputs bound; they must not need gradients).
        x: the layer input ``[T, H]``.
        stash: host memory for ``x`` (``None``: ``x`` stays on the device).

    The output needs gradients whenever autograd is on, also when ``x`` does not (frozen
    embeddings): the layer's parameters still get theirs. A :class:`SelfCheckpointed` run keeps its
    input itself (in ``stash`` when given).
    """
    if isinstance(run, SelfCheckpointed):
        return run.run(x, stash)
    anchor = None if x.requires_grad else torch.empty(0, requires_grad=True)
    return _Checkpoint.apply(x, anchor, run, stash)


def checkpoint_block(runs: Sequence[Callable[[Tensor], Tensor]]) -> Callable[[Tensor], Tensor]:
    """The layers ``runs`` one after another as one function for :func:`checkpoint_layer`: a second
    checkpoint level. The block's input is all that is kept for the backward; when the backward
    recomputes the block, each of its layers is checkpointed again (its input kept on the device),
    so the block's backward holds ``len(runs)`` layer inputs and one layer's working set. Each layer's
    forward runs three times a step instead of two; the inputs kept through the whole step drop to one
    per block.
    """
    def run(x: Tensor) -> Tensor:
        for layer in runs:
            x = checkpoint_layer(layer, x) if torch.is_grad_enabled() else layer(x)
        return x
    return run
