"""Where one request's tokens sit in a CP rank's buffer (pure bookkeeping, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megacp.placement.sharding import Range


@dataclass(frozen=True)
class SeqLayout:
    """Where one request's keys or queries sit in a rank's buffer.

    The request occupies ``[offset, offset + length)``: first ``prefix`` cached tokens (all at
    positions before this step's new tokens, so visible to every new query of the request), then the
    new tokens of ``ranges`` in position order.
    """

    offset: int
    prefix: int
    ranges: tuple[Range, ...]

    @property
    def num_new(self) -> int:
        return sum(b - a for a, b in self.ranges)

    @property
    def length(self) -> int:
        return self.prefix + self.num_new


def pack_layouts(prefixes: Sequence[int], ranges: Sequence[Sequence[Range]]) -> list[SeqLayout]:
    """Lay requests out back to back: request i holds ``prefixes[i]`` cached tokens, then its new
    tokens ``ranges[i]``."""
    out, off = [], 0
    for p, rs in zip(prefixes, ranges):
        lay = SeqLayout(off, p, tuple(rs))
        out.append(lay)
        off += lay.length
    return out
