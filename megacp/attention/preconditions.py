"""Preconditions of a CP call that only the whole CP group can check.

Every rank of a ring must call the CP attention with the same sequence lengths, options, head
shapes and dtypes: otherwise the ranks post different collectives and return wrong results,
abort, or die in the transport. :func:`agree` compares a small signature of those values (one
int64 per field) across the group with **one** all-gather, and raises the same kind of error on
every rank, naming the fields that differ. It also carries each rank's own verdict on its inputs,
so that an input error found on one rank only is raised on every rank instead of leaving the
others waiting in the ring. Callers run it once per step (:class:`~megacp.layers.step.CPStep`) or
once per call (:func:`~megacp.attention.prefill.cp_attention`); it costs one small collective and,
on GPU, one host synchronisation.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import torch
from torch import Tensor

from megacp.parallel.ring import Ring

_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(q: Tensor, k: Tensor, v: Tensor, where: str) -> str | None:
    """What is wrong with ``q``/``k``/``v`` as attention inputs (dtype, device, autograd), or ``None``.

    Attention runs on fp16, bf16 or fp32 tensors of one dtype on one device (fp64 would be
    computed in fp32 by the reference path and integers have no attention).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _FLOAT_TYPES:
            return f"{where} needs fp16, bf16 or fp32 inputs; {name} is {t.dtype}"
    if not q.dtype == k.dtype == v.dtype:
        return f"{where} needs q, k and v of one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if not q.device == k.device == v.device:
        return f"{where} needs q, k and v on one device; got q {q.device}, k {k.device}, v {v.device}"
    return None


_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer type of each element size: a tensor's bits read as integers by :func:`content_digest`."""

_DIGEST_CHUNK = 1 << 22
"""Elements digested at a time (bounds the temporaries to a few tens of MiB)."""


def content_digest(t: Tensor) -> Tensor:
    """A 0-d int64 digest of ``t``'s contents (its elements' bits in row-major order), computed on
    ``t``'s device without a host synchronisation: ``sum(bits_i * w_i) mod 2**64`` with odd weights
    ``w_i`` mixed from the position ``i``, so a changed element always changes it and reordered
    elements almost surely do. Shape and dtype are not part of it (agree on them separately).
    Costs one pass over ``t``: cheap beside attention over it."""
    flat = t.detach().contiguous().view(-1)
    bits = flat.view(_WORDS[flat.element_size()]) if flat.dtype != torch.bool else flat.to(torch.int8)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _DIGEST_CHUNK):
        words = bits[start:start + _DIGEST_CHUNK].to(torch.int64)
        mixed = torch.arange(start, start + words.numel(), dtype=torch.int64, device=t.device) * -7046029254386353131
        weights = (mixed ^ (mixed >> 29)) * -4658895280553007687 | 1
        total += (words * weights).sum()
    return total


def _code(value: object) -> tuple[int, bool]:
    """``(int64 code, readable)``: ints and bools as they are, anything else hashed (a tensor, a
    :func:`content_digest`, is placed into the signature on its device instead: code 0)."""
    if isinstance(value, Tensor):
        return 0, False
    if isinstance(value, (bool, int)) and -(2**63) <= int(value) < 2**63:
        return int(value), True
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0], False
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True), False


def agree(ring: Ring | None, fields: Sequence[tuple[str, object]], *, device: torch.device, what: str,
          local_error: str | None = None) -> None:
    """Raise ``ValueError`` on every rank of ``ring`` unless all ranks passed equal ``fields`` and
    none reported a ``local_error``.

    Args:
        ring: the CP ring (``None`` or one rank: only ``local_error`` is checked).
        fields: ``(name, value)`` pairs, the same names in the same order on every rank; values are
            ints, bools, floats, strings, dtypes or (nested) sequences of them, or 0-d int64
            tensors (:func:`content_digest`: compared without a host synchronisation of their own).
        device: where the signature travels (a CUDA device for an NCCL group).
        what: the call, for the message (e.g. ``"cp_attention"``).
        local_error: this rank's verdict on its own inputs (``None`` = fine).
    """
    if ring is None or ring.size == 1:
        if local_error is not None:
            raise ValueError(local_error)
        return
    codes = [_code(value) for _, value in fields]
    sig = torch.tensor([local_error is not None] + [c for c, _ in codes], dtype=torch.int64, device=device)
    for i, (_, value) in enumerate(fields, start=1):
        if isinstance(value, Tensor):
            sig[i] = value.to(device)
    rows = ring.all_gather(sig).tolist()  # [N ranks, 1 + fields]
    if local_error is not None:
        raise ValueError(local_error)
    failed = [j for j, row in enumerate(rows) if row[0]]
    if failed:
        raise ValueError(f"{what}: CP rank(s) {failed} refused their inputs (their error says why)")
    differ = []
    for i, ((name, value), (_, readable)) in enumerate(zip(fields, codes), start=1):
        if len({row[i] for row in rows}) > 1:
            if readable:
                show = bool if isinstance(value, bool) else int
                differ.append(f"{name} ({', '.join(f'rank {j}: {show(row[i])}' for j, row in enumerate(rows))})")
            else:
                others = [j for j, row in enumerate(rows) if row[i] != rows[ring.rank][i]]
                mine = "its own" if isinstance(value, Tensor) else repr(value)
                differ.append(f"{name} (rank {ring.rank} has {mine}, rank(s) {others} another value)")
    if differ:
        raise ValueError(f"{what}: the {ring.size} CP ranks must pass the same values but differ in " + "; ".join(differ))
