"""The sparse mixture-of-experts MLP of Mixtral and Qwen2-MoE, with experts sharded over an
expert-parallel (EP) group.

Routing (Hugging Face numerics): the router's logits [T, E] go through a softmax in fp32, each token
keeps its top-k experts, and the k weights are renormalised to sum to 1 when ``norm_topk_prob``
(always for Mixtral; as configured for Qwen2-MoE). The block's output is
``Σ_k w_k · expert_{i_k}(h)`` with ``h`` the RMSNorm of the input; Qwen2-MoE adds
``sigmoid(h · shared_gate) · shared_expert(h)``. Every expert is a SwiGLU MLP. Nothing is dropped:
there is no capacity limit, every token copy reaches its expert.

Expert parallelism: rank e of an EP group of size P holds experts ``[e·E/P, (e+1)·E/P)`` (E must
divide by P). Each forward:

1. every rank routes its own tokens and sorts its token copies (T·k of them) by expert;
2. the per-expert copy counts travel in one ``all_to_all_single`` so every rank knows its receive
   split sizes, then the copies travel in a second one to the ranks owning their experts;
3. each rank runs its local experts on what it received;
4. a third ``all_to_all_single`` (split sizes swapped) returns the outputs to the copies' senders,
   which combine them with their routing weights.

All ranks of the EP group call the same collectives in every MoE layer (a rank without tokens sends
and receives nothing). With P = 1 the same code runs without collectives, and trains like any other
layer (every rank holds every expert; DeepSpeed reduces expert gradients over DP x CP like the rest).
With P > 1 the copies' all-to-alls are differentiable (:func:`all_to_all`: the backward sends the
gradients back by the reverse all-to-all), so each rank's expert gradients sum the contributions of
every token copy its experts processed, from every rank of the EP group; reducing them over the
ranks that hold the same experts is the trainer's part (:mod:`megacp.train.experts`).

Tensor parallelism inside the EP group: megacp's EP group spans the ``dp x tp`` ranks of a cell (or
``dp x cp x tp``), and the ranks of one TP group hold *identical* tokens. With P > 1 each TP rank
therefore dispatches only its share of the tokens (rank t of a TP group of size S takes rows
``tensor_split(T, S)[t]``), so every token copy reaches its expert exactly once; the per-copy expert
outputs [T_t, k, H] of the shares are put back together by a sum over the TP group of zero-padded
[T, k, H] tensors (adding zeros is exact), and every TP rank combines all T tokens with the routing
weights of its own (replicated) router; in backward the shares' input gradients are summed over the
TP group (:func:`~megacp.models.ops.copy_to_tp`), so every TP rank gets the whole gradient of the
replicated input. With P = 1 every TP rank runs every token through its own
copy of all experts. The shared expert is TP-sharded like the dense MLP; routed experts are never
split by TP (each lives whole on one EP rank).

Per-rank expert load: :attr:`MoEMLP.expert_tokens` counts the token copies each local expert has
processed (cumulative, int64 on CPU); each forward logs this rank's counts at DEBUG level.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megacp.models.config import ModelConfig
from megacp.models.ops import copy_to_tp, group_size, reduce_from_tp, rms_norm, swiglu, tp_shard

logger = logging.getLogger(__name__)


def local_experts(num_experts: int, ep_size: int) -> int:
    """Experts per EP rank, ``num_experts // ep_size``.

    Raises:
        ValueError: ``ep_size`` does not divide ``num_experts``.
    """
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}"
        )
    return num_experts // ep_size


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """:func:`all_to_all` under autograd: the gradient of the received rows goes back to their
    senders by the reverse all-to-all (split sizes swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send rows ``x[sum(send[:p]) : sum(send[:p+1])]`` [R, ...] to rank p of ``group``; return the
    ``sum(recv)`` rows received, source by source (``all_to_all_single`` with split sizes).
    Differentiable: every rank of ``group`` runs the reverse all-to-all in backward."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _AllToAll.apply(x, send, recv, group)
    return _exchange(x, send, recv, group)


class MoEMLP(nn.Module):
    """RMSNorm, router, top-k dispatch to this EP rank's experts and back, weighted combine, and the
    optional sigmoid-gated shared expert.

    Parameters (E_l = E / EP local experts, F = ``moe_intermediate_size``, Fs =
    ``shared_expert_intermediate_size``, t = TP size)::

        layer_norm_weight   [H]
        router_weight       [E, H]
        expert_fc1_weight   [E_l, 2F, H]   (per expert: gate rows, then up)
        expert_fc2_weight   [E_l, H, F]
        shared_fc1_weight   [2Fs/t, H]     (Qwen2-MoE; gate rows then up, column-parallel)
        shared_fc2_weight   [H, Fs/t]      (row-parallel)
        shared_gate_weight  [1, H]
    """

    def __init__(
        self, cfg: ModelConfig, tp_group: dist.ProcessGroup | None = None,
        ep_group: dist.ProcessGroup | None = None, *, dtype: torch.dtype | None = None, device: Any = None,
    ):
        super().__init__()
        h, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size or cfg.intermediate_size
        self.tp_group, self.ep_group = tp_group, ep_group
        self.ep_size = group_size(ep_group)
        self.num_local = local_experts(e, self.ep_size)
        self.first_expert = (0 if ep_group is None else dist.get_rank(ep_group)) * self.num_local
        self.top_k, self.norm_topk_prob, self.eps = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.rms_norm_eps

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))

        self.layer_norm_weight = param(h)
        self.router_weight = param(e, h)
        self.expert_fc1_weight = param(self.num_local, 2 * f, h)
        self.expert_fc2_weight = param(self.num_local, h, f)
        self.shared_fc1_weight = self.shared_fc2_weight = self.shared_gate_weight = None
        if cfg.shared_expert_intermediate_size:
            fs = tp_shard(cfg.shared_expert_intermediate_size, group_size(tp_group), "shared_expert_intermediate_size")
            self.shared_fc1_weight = param(2 * fs, h)
            self.shared_fc2_weight = param(h, fs)
            self.shared_gate_weight = param(1, h)
        self.expert_tokens = torch.zeros(self.num_local, dtype=torch.int64)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of normed tokens ``h`` [T, H]: (weights [T, k] fp32, expert ids [T, k] int64)."""
        probs = torch.softmax(F.linear(h, self.router_weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]."""
        h = rms_norm(x, self.layer_norm_weight, self.eps)
        weights, experts = self.route(h)
        tp = group_size(self.tp_group)
        if self.ep_size == 1 or tp == 1:
            y = self._dispatch(h, experts)
        else:  # this TP rank's share of the (identical) tokens; see the module docstring
            rows = torch.tensor_split(torch.arange(h.shape[0], device=h.device), tp)[dist.get_rank(self.tp_group)]
            y_share = self._dispatch(copy_to_tp(h, self.tp_group)[rows], experts[rows])
            y = reduce_from_tp(
                h.new_zeros(h.shape[0], self.top_k, h.shape[1]).index_copy(0, rows, y_share), self.tp_group
            )
        out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)
        if self.shared_fc1_weight is not None and self.shared_fc2_weight is not None and self.shared_gate_weight is not None:
            shared = reduce_from_tp(
                swiglu(copy_to_tp(h, self.tp_group), self.shared_fc1_weight, self.shared_fc2_weight), self.tp_group
            )
            out = out + torch.sigmoid(F.linear(h, self.shared_gate_weight)) * shared
        return out

    def _dispatch(self, h: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Expert outputs [T, k, H] of tokens ``h`` [T, H] for their experts ``experts`` [T, k],
        computed on the EP ranks that own the experts."""
        t, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token copies grouped by expert
        per_expert = torch.bincount(flat, minlength=self.num_local * self.ep_size)
        send = h.index_select(0, order // k)
        if self.ep_size == 1:
            received, recv_per_expert = send, per_expert.view(1, -1)
        else:
            recv_per_expert = torch.empty_like(per_expert)
            dist.all_to_all_single(recv_per_expert, per_expert, group=self.ep_group)
            recv_per_expert = recv_per_expert.view(self.ep_size, self.num_local)
            send_split = per_expert.view(self.ep_size, self.num_local).sum(1).tolist()
            recv_split = recv_per_expert.sum(1).tolist()
            received = all_to_all(send, send_split, recv_split, self.ep_group)
        out = self._run_experts(received, recv_per_expert)
        if self.ep_size > 1:
            out = all_to_all(out, recv_split, send_split, self.ep_group)
        return torch.empty_like(out).index_copy(0, order, out).view(t, k, h.shape[1])

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts applied to ``rows`` [R, H], which arrive source by source, each
        source's rows grouped by local expert with ``counts`` [sources, E_l] rows per expert."""
        local = torch.repeat_interleave(
            torch.arange(self.num_local, device=rows.device).repeat(counts.shape[0]), counts.reshape(-1)
        )
        order = torch.argsort(local, stable=True)
        totals = counts.sum(0).cpu()
        self.expert_tokens += totals
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("experts %d..%d received %s token copies", self.first_expert,
                         self.first_expert + self.num_local - 1, totals.tolist())
        grouped = rows.index_select(0, order)
        outputs = [
            swiglu(part, self.expert_fc1_weight[e], self.expert_fc2_weight[e])
            for e, part in enumerate(grouped.split(totals.tolist()))
        ]
        result = torch.cat(outputs) if outputs else grouped
        return torch.empty_like(result).index_copy(0, order, result)
