"""The placement rule: which CP rank holds which token, where it sits in the rank's buffer, and
which kernel calls (tiles) a rank's queries make over another rank's keys. Pure host-side integer
bookkeeping, identical on every rank; nothing here communicates or runs a kernel."""

from megacp.placement.layout import SeqLayout
from megacp.placement.plan import ShardPlan
from megacp.placement.sharding import held_after, local_counts, positions_from_history, seq_lengths, shard_ranges
from megacp.placement.tiles import Tile, key_groups, plan_tiles, restrict_rows, split_keys

__all__ = [
    "SeqLayout",
    "ShardPlan",
    "Tile",
    "held_after",
    "key_groups",
    "local_counts",
    "plan_tiles",
    "positions_from_history",
    "restrict_rows",
    "seq_lengths",
    "shard_ranges",
    "split_keys",
]
