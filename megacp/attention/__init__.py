"""CP attention: partial attention + merge, running planned tiles, pass-KV / pass-Q ring prefill,
all-gather decode, the strategy choice and the training backward. Nothing here knows about models."""

from megacp.attention.decode import allgather_decode
from megacp.attention.merge import merge_into, merge_stack, merge_states
from megacp.attention.partial import partial_attention
from megacp.attention.pass_kv import ring_pass_kv
from megacp.attention.pass_q import ring_pass_q
from megacp.attention.prefill import (
    build_kv_block,
    cp_attention,
    cp_prefill,
    resolve_strategy,
)
from megacp.attention.strategy import Hardware, calibrate, choose_strategy
from megacp.attention.training import ring_attention

__all__ = [
    "Hardware",
    "allgather_decode",
    "build_kv_block",
    "calibrate",
    "choose_strategy",
    "cp_attention",
    "cp_prefill",
    "merge_into",
    "merge_stack",
    "merge_states",
    "partial_attention",
    "resolve_strategy",
    "ring_attention",
    "ring_pass_kv",
    "ring_pass_q",
]
