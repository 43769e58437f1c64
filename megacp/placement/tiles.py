"""Turning buffer layouts into kernel calls (pure planning; :mod:`megacp.attention.tile_attention`
runs them).

Given where a block's queries sit (:class:`~megacp.placement.layout.SeqLayout` per request, no
prefix) and where a KV block's keys sit (per request: cached prefix, then new tokens), every query
at position ``x`` sees the prefix plus the new keys at positions ``<= x`` of its own request. Keys of
a request are stored in position order, so the visible keys of a query always form a prefix of the
request's keys, and along a run of consecutive queries that prefix either stays the same length
(a *dense* tile) or grows by one per query (a *causal* tile, bottom-right aligned). Fully masked
query runs produce no tile at all. This yields the paper's three tile kinds for the load-balanced
ring — causal on the local chunks, the first received chunk dense for all local queries, the whole
received block dense for the second local chunk — and extends them to cached prefixes, ragged
batches and any sharding, with one kernel call per tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megacp.placement.layout import SeqLayout


@dataclass(frozen=True)
class Tile:
    """Queries ``[q0, q1)`` of the query buffer attend keys ``[k0, k1)`` of the KV buffer;
    ``causal`` means bottom-right aligned (the last query sees all ``k1 - k0`` keys)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _request_tiles(q: SeqLayout, kv: SeqLayout) -> list[Tile]:
    tiles: list[Tile] = []
    # key segments in buffer order: (buffer start, position start, position end)
    segs, off = [], kv.offset + kv.prefix
    for a, b in kv.ranges:
        segs.append((off, a, b))
        off += b - a
    q_off = q.offset
    for qa, qb in q.ranges:
        cuts = sorted({qa, qb, *(s for _, s, _ in segs if qa < s < qb), *(e for _, _, e in segs if qa < e < qb)})
        for x0, x1 in zip(cuts, cuts[1:]):
            rows = (q_off + x0 - qa, q_off + x1 - qa)
            inside = [(buf, s) for buf, s, e in segs if s <= x0 < e]
            if inside:  # one key segment overlaps these queries: bottom-right causal
                buf, s = inside[0]
                tiles.append(Tile(*rows, kv.offset, buf + (x1 - 1 - s) + 1, True))
            else:
                visible = kv.prefix + sum(e - s for _, s, e in segs if e <= x0)
                if visible:
                    tiles.append(Tile(*rows, kv.offset, kv.offset + visible, False))
        q_off += qb - qa
    return tiles


def _coalesce(tiles: list[Tile]) -> list[Tile]:
    """Merge neighbouring tiles into one call where the union is still dense or causal."""
    out: list[Tile] = []
    for t in tiles:
        if out:
            p = out[-1]
            if p.q1 == t.q0 and p.k0 == t.k0 and p.causal == t.causal:
                if (not t.causal and p.k1 == t.k1) or (t.causal and t.k1 - p.k1 == t.q1 - t.q0):
                    out[-1] = Tile(p.q0, t.q1, p.k0, t.k1, t.causal)
                    continue
        out.append(t)
    return out


def plan_tiles(q_layout: Sequence[SeqLayout], kv_layout: Sequence[SeqLayout]) -> list[Tile]:
    """Kernel calls for queries laid out as ``q_layout`` over keys laid out as ``kv_layout``
    (same requests, same order). Tiles of one request never overlap in queries."""
    if len(q_layout) != len(kv_layout):
        raise ValueError(f"query layout has {len(q_layout)} requests, KV layout {len(kv_layout)}")
    tiles: list[Tile] = []
    for q, kv in zip(q_layout, kv_layout):
        tiles.extend(_coalesce(_request_tiles(q, kv)))
    return tiles
