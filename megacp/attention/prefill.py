"""CP prefill entry points: pick the strategy and run the ring over this rank's KV block.

:func:`cp_prefill` is what the CP attention layer (and users with their own loop) call with local
shards: queries of this rank in the plan's layout and its KV block
(:func:`~megacp.attention.blocks.build_kv_block`: its new keys/values and, when a KV cache holds
earlier tokens, its cached tokens of each request). :func:`cp_attention` takes whole sequences.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megacp.attention.blocks import FP8KVBlock, KVBlock, build_kv_block
from megacp.attention.pass_kv import ring_pass_kv
from megacp.attention.pass_q import ring_pass_q
from megacp.attention.preconditions import agree, check_inputs, content_digest
from megacp.attention.strategy import STRATEGIES, Choice, choose_strategy, hardware_for
from megacp.parallel.ring import Ring
from megacp.placement import ShardPlan, seq_lengths

log = logging.getLogger("megacp.prefill")


def resolve_strategy(strategy: str, plan: ShardPlan, num_heads: int, num_kv_heads: int,
                     elem_bytes: int, device: torch.device, group: dist.ProcessGroup | None = None, *,
                     cache_dir: str | None = None) -> Choice | str:
    """``"pass_kv"``/``"pass_q"`` as given; ``"auto"`` applies the paper's rule to the batch totals
    (a :class:`Choice` with every input, logged at debug level) with the numbers the CP ``group``
    agreed on (:func:`~megacp.attention.strategy.hardware_for`: pass the group, and call this on
    every rank of it); ``cache_dir`` holds the host's calibration (``None``: ``~/.cache/megacp``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"prefill strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if strategy != "auto":
        return strategy
    choice = choose_strategy(
        sum(plan.new), sum(plan.cached), num_heads=num_heads, num_kv_heads=num_kv_heads,
        cp_size=plan.cp_size, elem_bytes=elem_bytes, hw=hardware_for(device, plan.cp_size, group, cache_dir=cache_dir),
    )
    log.debug("prefill strategy %s", choice)
    return choice


def strategy_name(choice: Choice | str) -> str:
    """The strategy a :func:`resolve_strategy` result names (``"pass_kv"`` or ``"pass_q"``)."""
    return choice if isinstance(choice, str) else choice.strategy


def cp_prefill(
    q: Tensor,
    kv_block: KVBlock | FP8KVBlock,
    plan: ShardPlan,
    ring: Ring | None,
    *,
    strategy: str = "pass_kv",
    scale: float | None = None,
    backend: str | None = None,
) -> Tensor:
    """Exact causal attention of this rank's new queries over all ranks' keys.

    Args:
        q: ``[n_local, Hq, D]`` local queries; kv_block: from :func:`build_kv_block`, or an
            :class:`FP8KVBlock` of its FP8 form (pass-KV passes its bytes; both dequantise it a key tile at a time).
        strategy: ``"pass_kv"`` or ``"pass_q"`` (resolve ``"auto"`` with :func:`resolve_strategy`).

    Returns:
        ``[n_local, Hq, D]`` in ``q.dtype``.
    """
    if q.shape[0] != plan.num_local():
        raise ValueError(f"q has {q.shape[0]} tokens but the plan gives this rank {plan.num_local()}")
    if strategy == "pass_kv":
        out, _ = ring_pass_kv(q, kv_block, plan, ring, scale=scale, backend=backend)
    elif strategy == "pass_q":
        out, _ = ring_pass_q(q, kv_block, plan, ring, scale=scale, backend=backend)
    else:
        raise ValueError(f"prefill strategy {strategy!r} must be resolved to pass_kv or pass_q")
    return out.to(q.dtype)


def _input_error(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor | Sequence[int] | None) -> tuple[str | None, list[int] | None]:
    """``(what is wrong with cp_attention's inputs or None, the sequence lengths or None)``."""
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or k.shape[0] != q.shape[0]:
        return (f"cp_attention expects q [T,Hq,D] and k, v [T,Hkv,D] with the same T; got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}"), None
    try:
        lens = [q.shape[0]] if cu_seqlens is None else seq_lengths(cu_seqlens, q.shape[0])
    except ValueError as exc:
        return str(exc), None
    error = check_inputs(q, k, v, "cp_attention")
    if error is None and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        error = ("cp_attention computes without autograd (its output is gathered from every rank); inputs that "
                 "require grad need megacp.attention.ring_attention on this rank's shard, or the CP layer")
    return error, lens


def cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: "torch.distributed.ProcessGroup | Ring | None" = None,
    *,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    strategy: str = "auto",
    load_balance: bool = True,
    scale: float | None = None,
    backend: str | None = None,
    window: int | None = None,
) -> Tensor:
    """Causal attention of whole packed sequences computed with CP over ``group``.

    A convenience for checking exactness (tests, notebooks): every rank passes the same full inputs;
    each rank keeps only its shard, the ring computes, and the output is gathered back.

    Args:
        q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (identical on every rank).
        group: the CP process group, or a :class:`~megacp.parallel.ring.Ring` over it (another
            transport or window size); ``None`` = the whole world (world of one without init).
        cu_seqlens: int32 ``[B+1]`` sequence boundaries (default: one sequence).
        window: sliding window (a query at position ``x`` sees keys ``x - window + 1 .. x`` of its
            sequence; ``None``: full causal). Tiles outside the window are skipped.

    Every rank must pass the same inputs and options: a difference in shapes, dtypes, lengths,
    options or the inputs' contents (:func:`~megacp.attention.preconditions.content_digest`, one
    pass over each), or an input refused on one rank, is one ``ValueError`` on every rank, found by
    one small all-gather before any other work (:func:`~megacp.attention.preconditions.agree`). The output
    carries no autograd graph: inputs that require gradients are refused (training runs
    :func:`~megacp.attention.training.ring_attention` on each rank's shard, or the CP layer).

    Returns:
        ``[T, Hq, D]``, the full output, on every rank.
    """
    ring = group if isinstance(group, Ring) else Ring(group) if dist.is_initialized() else None
    error, lens = _input_error(q, k, v, cu_seqlens)
    fields = [("q shape", tuple(q.shape)), ("k shape", tuple(k.shape)), ("v shape", tuple(v.shape)),
              ("dtypes of q, k, v", (str(q.dtype), str(k.dtype), str(v.dtype))), ("sequence lengths", lens),
              ("strategy", strategy), ("load_balance", load_balance), ("scale", scale), ("backend", backend),
              ("sliding window", window),
              *((f"{name} contents", content_digest(x) if error is None else None) for name, x in (("q", q), ("k", k), ("v", v)))]
    agree(ring, fields, device=q.device, what="cp_attention", local_error=error)
    assert lens is not None  # agree raised on every rank when this rank could not read them
    n, r = (ring.size, ring.rank) if ring else (1, 0)
    plan = ShardPlan([0] * len(lens), lens, n, r, load_balance=load_balance).with_window(window)
    idx = plan.local_index().to(q.device)
    ql, kl, vl = q[idx], k[idx], v[idx]
    name = strategy_name(resolve_strategy(strategy, plan, q.shape[1], k.shape[1], k.element_size(), q.device,
                                          ring.group if ring else None))
    out_local = cp_prefill(ql, build_kv_block(plan, kl, vl), plan, ring, strategy=name, scale=scale, backend=backend)
    if ring is None or n == 1:
        return out_local
    padded = out_local.new_zeros((plan.max_local, *out_local.shape[1:]))
    padded[: out_local.shape[0]] = out_local
    gathered = ring.all_gather(padded)
    out = torch.empty_like(q)
    for j in range(n):
        ij = plan.local_index(j).to(q.device)
        out[ij] = gathered[j, : ij.numel()]
    return out
