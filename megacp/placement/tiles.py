"""Turning buffer layouts into kernel calls (pure planning; :mod:`megacp.attention.kernels.tile_attention`
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

Sliding windows (``window=W``, transformers' convention: a query at position ``x`` sees the keys at
positions ``x - W + 1 .. x``): the planner splits the visible keys of a query run by key segment
(positions are contiguous within one), drops the keys before the first query's window and the
queries past the last key's window, and skips a pair that keeps nothing (no tile: no kernel call,
the ring still rotates). A pair the window covers for every query runs as without a window; a
partially covered pair gets ``left``, the band bound of the flash kernels' ``window_size_left``.
Cached prefixes carry no positions in the layout: a windowed plan over them takes the position runs
of each request's cached keys (``prefix_runs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megacp.placement.layout import SeqLayout
from megacp.placement.sharding import Range


@dataclass(frozen=True)
class Tile:
    """Queries ``[q0, q1)`` of the query buffer attend keys ``[k0, k1)`` of the KV buffer;
    ``causal`` means bottom-right aligned (the last query sees all ``k1 - k0`` keys). ``left`` (a
    windowed tile) bounds the band from below, bottom-right aligned as the flash kernels'
    ``window_size_left``: query ``i`` sees key ``j`` only if ``j >= i + (k1 - k0) - (q1 - q0) - left``."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    left: int | None = None


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


def _windowed_request_tiles(q: SeqLayout, kv: SeqLayout, window: int, prefix_runs: Sequence[Range] | None) -> list[Tile]:
    """:func:`_request_tiles` under a sliding window of ``window`` keys (one tile per query run and
    key segment the window reaches); ``prefix_runs``: positions of the cached keys, in buffer order."""
    runs = tuple(prefix_runs or ())
    if sum(b - a for a, b in runs) != kv.prefix:
        raise ValueError(f"a sliding-window plan needs the positions of the {kv.prefix} cached keys; got runs {list(runs)}")
    tiles: list[Tile] = []
    segs, off = [], kv.offset
    for a, b in (*runs, *kv.ranges):
        segs.append((off, a, b))
        off += b - a
    q_off = q.offset
    for qa, qb in q.ranges:
        cuts = sorted({qa, qb, *(s for _, s, _ in segs if qa < s < qb), *(e for _, _, e in segs if qa < e < qb)})
        for x0, x1 in zip(cuts, cuts[1:]):
            for buf, s, e in segs:
                causal = s <= x0 < e
                if not causal and e > x0:  # keys after these queries
                    continue
                hi = x1 if causal else e  # keys [s, hi) are visible by causality
                lo = max(s, x0 - window + 1)  # before the first query's window
                y1 = min(x1, hi - 1 + window)  # queries up to hi - 1 + window - 1 see a key
                if lo >= hi or y1 <= x0:
                    continue
                k_hi = min(hi, y1) if causal else hi
                left = None
                if (y1 - 1) - window + 1 > lo:  # the last query's window starts after key lo: a band  # j >= i + (x0 - lo) - window + 1, as a bound from the bottom-right diagonal
                    left = (k_hi - lo) - (y1 - x0) - (x0 - lo) + window - 1
                tiles.append(Tile(q_off + x0 - qa, q_off + y1 - qa, buf + lo - s, buf + k_hi - s, causal, left))
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


def plan_tiles(q_layout: Sequence[SeqLayout], kv_layout: Sequence[SeqLayout], window: int | None = None,
               prefix_runs: Sequence[Sequence[Range]] | None = None) -> list[Tile]:
    """Kernel calls for queries laid out as ``q_layout`` over keys laid out as ``kv_layout``
    (same requests, same order), under a sliding window of ``window`` keys (``None``: full causal;
    ``prefix_runs[i]``: the position runs of request ``i``'s cached keys, needed with a window).
    Without a window the tiles of one request never overlap in queries; with one, a query run can
    meet several key segments (one tile each, merged as partial states)."""
    if len(q_layout) != len(kv_layout):
        raise ValueError(f"query layout has {len(q_layout)} requests, KV layout {len(kv_layout)}")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must hold at least 1 key, got {window}")
    tiles: list[Tile] = []
    for i, (q, kv) in enumerate(zip(q_layout, kv_layout)):
        if window is None:
            tiles.extend(_coalesce(_request_tiles(q, kv)))
        else:
            tiles.extend(_windowed_request_tiles(q, kv, window, prefix_runs[i] if prefix_runs else None))
    return tiles


def restrict_rows(tiles: Sequence[Tile], a: int, b: int) -> list[Tile]:
    """``tiles`` cut to the query rows ``[a, b)`` and renumbered from ``a`` (row ``a`` becomes row 0):
    the kernel calls of a query tile (a training layer's attention over tiles of its queries). A
    causal tile keeps the keys its last kept row sees (bottom-right aligned, as before); a dense
    windowed tile moves its band bound ``left`` by the rows cut from its end. Tiles without a kept
    row are dropped."""
    if a > b:
        raise ValueError(f"query rows [{a}, {b}) are empty the wrong way round")
    out: list[Tile] = []
    for t in tiles:
        lo, hi = max(t.q0, a), min(t.q1, b)
        if lo >= hi:
            continue
        cut = t.q1 - hi  # rows dropped from the tile's end
        if t.causal:
            out.append(Tile(lo - a, hi - a, t.k0, t.k1 - cut, True, t.left))
        else:
            out.append(Tile(lo - a, hi - a, t.k0, t.k1, False, None if t.left is None else t.left + cut))
    return out


def split_keys(tiles: Sequence[Tile], max_keys: int) -> list[Tile]:
    """``tiles`` with every tile that reads more than ``max_keys`` keys cut, where its mask allows,
    into tiles of at most ``max_keys`` keys (queries whose rows overlap are merged as partial
    states). The keys every query of a tile sees — all of a dense tile's, a causal tile's keys
    before its last ``q1 - q0`` — go in dense pieces of ``max_keys``; a causal tile's last
    ``q1 - q0`` keys stay one causal tile, and a windowed (``left``) tile stays whole (it reads at
    most its queries plus the window). So each piece reads at most ``max(max_keys, q1 - q0 + window)``
    keys: what an FP8 block dequantises at a time (:mod:`megacp.attention.blocks`)."""
    if max_keys < 1:
        raise ValueError(f"a key tile must hold at least 1 key, got {max_keys}")
    out: list[Tile] = []
    for t in tiles:
        if t.left is not None or t.k1 - t.k0 <= max(max_keys, t.q1 - t.q0 if t.causal else 0):
            out.append(t)
            continue
        dense_end = t.k1 - (t.q1 - t.q0) if t.causal else t.k1  # keys [k0, dense_end) are seen by every query
        out.extend(Tile(t.q0, t.q1, a, min(a + max_keys, dense_end), False) for a in range(t.k0, dense_end, max_keys))
        if t.causal:
            out.append(Tile(t.q0, t.q1, dense_end, t.k1, True))
    return out


def key_groups(tiles: Sequence[Tile], max_keys: int) -> list[tuple[int, int, list[Tile]]]:
    """``tiles`` (in order) as consecutive groups whose keys span at most ``max_keys`` rows (a tile
    longer than that forms a group alone): ``(k0, k1, tiles)``, the key span ``[k0, k1)`` one group
    reads. Short tiles (packed documents) thus share one read of their keys."""
    groups: list[tuple[int, int, list[Tile]]] = []
    for t in tiles:
        if groups:
            a, b, group = groups[-1]
            lo, hi = min(a, t.k0), max(b, t.k1)
            if hi - lo <= max_keys:
                groups[-1] = (lo, hi, [*group, t])
                continue
        groups.append((t.k0, t.k1, [t]))
    return groups
