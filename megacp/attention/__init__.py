"""CP attention in two floors. Nothing here knows about models.

* The kernel floor, :mod:`megacp.attention.kernels`: attention of one block of queries over one
  block of keys — partial attention returning (out, LSE) and its backward, the fused kernels behind
  them and the one registry of the backends, runs of packed tiles, planned tiles folded into a
  running state, the exact merges, cuDNN plans, the FP8 decode kernel.
* The ring floor, above it: the KV blocks the rings pass and the ring checks
  (:mod:`~megacp.attention.blocks`), pass-KV / pass-Q ring prefill (:mod:`~megacp.attention.pass_kv`,
  :mod:`~megacp.attention.pass_q`, :mod:`~megacp.attention.prefill`), all-gather decode
  (:mod:`~megacp.attention.decode`), the differentiable training ring
  (:mod:`~megacp.attention.training`), the strategy choice (:mod:`~megacp.attention.strategy`) and
  the checks a whole CP group makes (:mod:`~megacp.attention.preconditions`).

The public names below are imported on first use (PEP 562), so that importing a kernel module,
or :mod:`megacp.config` reading the registry, loads no ring code.
"""

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "Hardware": "megacp.attention.strategy",
    "allgather_decode": "megacp.attention.decode",
    "build_kv_block": "megacp.attention.blocks",
    "calibrate": "megacp.attention.strategy",
    "choose_strategy": "megacp.attention.strategy",
    "cp_attention": "megacp.attention.prefill",
    "cp_prefill": "megacp.attention.prefill",
    "merge_into": "megacp.attention.kernels.merge",
    "merge_stack": "megacp.attention.kernels.merge",
    "merge_states": "megacp.attention.kernels.merge",
    "partial_attention": "megacp.attention.kernels.partial",
    "resolve_strategy": "megacp.attention.prefill",
    "ring_attention": "megacp.attention.training",
    "ring_pass_kv": "megacp.attention.pass_kv",
    "ring_pass_q": "megacp.attention.pass_q",
}
"""Public name -> the module that defines it."""

if TYPE_CHECKING:
    from megacp.attention.blocks import build_kv_block
    from megacp.attention.decode import allgather_decode
    from megacp.attention.kernels.merge import merge_into, merge_stack, merge_states
    from megacp.attention.kernels.partial import partial_attention
    from megacp.attention.pass_kv import ring_pass_kv
    from megacp.attention.pass_q import ring_pass_q
    from megacp.attention.prefill import cp_attention, cp_prefill, resolve_strategy
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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megacp.attention' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
