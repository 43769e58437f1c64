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


def _code(value: object) -> tuple[int, bool]:
    """``(int64 code, readable)``: ints and bools as they are, anything else hashed."""
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
            ints, bools, floats, strings, dtypes or (nested) sequences of them.
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
                differ.append(f"{name} (rank {ring.rank} has {value!r}, rank(s) {others} another value)")
    if differ:
        raise ValueError(f"{what}: the {ring.size} CP ranks must pass the same values but differ in " + "; ".join(differ))
