"""The context-parallel attention of other libraries, measured next to megacp in the same run.

* :class:`TorchCP` — ``torch.distributed.tensor.experimental.context_parallel`` (DeviceMesh of the
  ranks, head-tail load balancing) around ``F.scaled_dot_product_attention(is_causal=True)``;
* :class:`TransformerEngineCP` — ``te.DotProductAttention`` with ``set_context_parallel_group``,
  inputs in the 2N-chunk load-balanced layout;
* :class:`UlyssesCP` — ``deepspeed.sequence.layer.DistributedAttention`` around cuDNN SDPA.

Each peer sets ``reason`` (why it cannot run; ``None`` when it can), agreed on every rank, so
that every rank skips the same peers.
"""

from __future__ import annotations

import argparse
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from scripts.bench.harness.accuracy import diff_stats
from scripts.bench.harness.context import Ctx, agree
from scripts.bench.harness.data import shared_randn
from scripts.bench.harness.timing import Timing, measure


def _agreed(ctx: Ctx, reason: str | None) -> str | None:
    """``reason``, or a reason for every rank when another rank has one."""
    if not agree(ctx, reason is None) and reason is None:
        return "unavailable on another rank"
    return reason


class TorchCP:
    """PyTorch's native CP (``context_parallel``); ``gqa[backend]``: native ``enable_gqa`` works."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.reason: str | None = None
        self.gqa: dict[str, bool] = {}
        if not ctx.cuda:
            self.reason = "PyTorch CP dispatches only the CUDA SDPA kernels (flash / efficient / cuDNN)"
        else:
            try:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor.experimental import context_parallel
                from torch.distributed.tensor.experimental._attention import (
                    context_parallel_unshard,
                    set_rotate_method,
                )
                from torch.nn.attention import SDPBackend, sdpa_kernel

                self.context_parallel, self.unshard = context_parallel, context_parallel_unshard
                self.set_rotate, self.sdpa_kernel = set_rotate_method, sdpa_kernel
                self.kernels = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                                "efficient": SDPBackend.EFFICIENT_ATTENTION}
                self.mesh = init_device_mesh("cuda", (ctx.world,), mesh_dim_names=("cp",))
            except Exception as e:  # noqa: BLE001
                self.reason = f"torch.distributed.tensor.experimental.context_parallel unavailable: {type(e).__name__}: {e}"
        self.reason = _agreed(ctx, self.reason)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, rotate: str, gqa: bool,
            timing: dict[str, Any] | None, want_out: bool) -> tuple[Timing | None, torch.Tensor | None]:
        """q ``[S, H, D]``, k/v ``[S, Hkv, D]``, whole, on every rank. ``timing``: keyword arguments of
        :func:`~scripts.bench.harness.timing.measure` (``None``: not timed). Returns (Timing | None,
        full output ``[S, H, D]`` | None)."""
        h, hkv = q.shape[1], k.shape[1]
        qt = q.permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, H, S, D]
        kt = k.permute(1, 0, 2).unsqueeze(0)
        vt = v.permute(1, 0, 2).unsqueeze(0)
        if not gqa and h != hkv:
            kt, vt = kt.repeat_interleave(h // hkv, dim=1), vt.repeat_interleave(h // hkv, dim=1)
        kt, vt = kt.contiguous(), vt.contiguous()
        bufs = [qt, kt, vt]
        tm, out = None, None
        self.set_rotate(rotate)
        try:
            with self.context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(bufs)):
                with self.sdpa_kernel([self.kernels[backend]]):
                    # attribute lookup at call time: context_parallel patches F.scaled_dot_product_attention
                    def fn() -> torch.Tensor:
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)

                    if timing is not None:
                        tm = measure(self.ctx, fn, **timing)
                    if want_out:
                        out = fn()
        finally:
            self.set_rotate("allgather")
        full = None
        if out is not None:
            full = self.unshard(self.mesh, [out.contiguous()], [2])[0][0].permute(1, 0, 2).contiguous()
        return tm, full

    def probe_gqa(self, backend: str, h: int, hkv: int, d: int) -> tuple[bool, str]:
        """Does ``enable_gqa=True`` run and give the right answer under torch's CP (small S)?"""
        ctx = self.ctx
        s = 2048 * ctx.world
        q = shared_randn((s, h, d), ctx, 11)
        k = shared_randn((s, hkv, d), ctx, 12)
        v = shared_randn((s, hkv, d), ctx, 13)
        why = ""
        try:
            _, full = self.run(q, k, v, backend, "allgather", True, None, True)
            ok_run = True
        except Exception as e:  # noqa: BLE001
            full, ok_run, why = None, False, f"{type(e).__name__}: {str(e)[:300]}"
        if not agree(ctx, ok_run):
            return False, f"enable_gqa=True fails under torch CP ({why if not ok_run else 'on another rank'})"
        with self.sdpa_kernel([self.kernels[backend]]):
            ref = F.scaled_dot_product_attention(q.permute(1, 0, 2)[None], k.permute(1, 0, 2)[None],
                                                 v.permute(1, 0, 2)[None], is_causal=True, enable_gqa=True)
        err = diff_stats(full, ref[0].permute(1, 0, 2))["max_abs"]
        if agree(ctx, err == err and err < 0.1):
            return True, "native enable_gqa=True"
        return False, f"enable_gqa=True gives wrong output under torch CP (max err {err:.3g})"


class TransformerEngineCP:
    """Transformer Engine's own CP (``te.DotProductAttention`` with a CP group)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.reason, self.te, self.version = ctx, None, None, "?"
        if not ctx.cuda:
            self.reason = "Transformer Engine needs CUDA"
        else:
            try:
                import transformer_engine
                import transformer_engine.pytorch as te

                self.te = te
                self.version = getattr(transformer_engine, "__version__", "?")
            except Exception as e:  # noqa: BLE001
                self.reason = f"import transformer_engine.pytorch failed: {type(e).__name__}: {str(e)[:300]}"
        self.reason = _agreed(ctx, self.reason)

    def module(self, h: int, hkv: int, d: int, comm: str) -> torch.nn.Module:
        """A causal ``bshd`` DotProductAttention whose CP group is every rank, ``cp_comm_type=comm``
        (``p2p``, ``all_gather``, ``a2a``)."""
        dpa = self.te.DotProductAttention(h, d, num_gqa_groups=hkv, attn_mask_type="causal", qkv_format="bshd")
        dpa = dpa.to(self.ctx.device)
        ranks = list(range(self.ctx.world))
        dpa.set_context_parallel_group(self.ctx.group, ranks, torch.cuda.Stream(device=self.ctx.device), comm)
        return dpa


class UlyssesCP:
    """DeepSpeed-Ulysses (heads scattered, sequence gathered; seq-first ``[S/N, B, H, D]`` shards)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.reason, self.version, self.takes_batch_dim = ctx, None, "?", False
        if not ctx.cuda:
            self.reason = "the DeepSpeed-Ulysses comparison uses CUDA SDPA (cuDNN) as its local attention"
        else:
            os.environ.setdefault("DS_ACCELERATOR", "cuda")
            try:
                import deepspeed
                import deepspeed.comm as dscomm
                from deepspeed.sequence.layer import DistributedAttention

                dscomm.init_distributed(dist_backend=ctx.backend, auto_mpi_discovery=False, verbose=False)
                self.cls = DistributedAttention
                self.version = getattr(deepspeed, "__version__", "?")
                self.takes_batch_dim = "batch_dim_idx" in inspect.signature(DistributedAttention.forward).parameters
            except Exception as e:  # noqa: BLE001
                self.reason = f"deepspeed unavailable: {type(e).__name__}: {str(e)[:300]}"
        self.reason = _agreed(ctx, self.reason)

    def module(self) -> torch.nn.Module:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        class LocalSDPA(torch.nn.Module):
            """Seq-first ``[S, B, h, D]`` in and out; cuDNN SDPA with GQA inside."""

            def forward(self, q, k, v, *args, **kwargs):
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    o = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                                       is_causal=True, enable_gqa=True)
                return o.permute(2, 0, 1, 3)

        # seq-first layout: scatter heads (dim 2), gather sequence (dim 0) — DeepSpeed's defaults
        return self.cls(LocalSDPA(), self.ctx.group, scatter_idx=2, gather_idx=0)

    def call(self, mod: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mod(q, k, v, 1) if self.takes_batch_dim else mod(q, k, v)


@dataclass
class Peers:
    """The peers a run asked for (``None`` where not asked for)."""

    torch_cp: TorchCP | None
    te: TransformerEngineCP | None
    ulysses: UlyssesCP | None


def setup_peers(ctx: Ctx, families: list[str], args: argparse.Namespace, note: Any) -> Peers:
    """Bring up the peers named in ``families`` (``torch``, ``te``, ``ds``) on every rank, probe
    torch CP's native GQA for each of ``args.torch_backends`` and record versions and probe results
    with ``note(key, value)`` (e.g. :meth:`Report.note`)."""
    torch_cp = TorchCP(ctx) if "torch" in families else None
    te = TransformerEngineCP(ctx) if "te" in families else None
    ulysses = UlyssesCP(ctx) if "ds" in families else None
    if torch_cp is not None and torch_cp.reason is None:
        for be in [b.strip() for b in args.torch_backends.split(",") if b.strip()]:
            try:
                good, how = torch_cp.probe_gqa(be, args.heads, args.kv_heads, args.head_dim)
            except Exception as e:  # noqa: BLE001
                good, how = False, f"probe failed: {type(e).__name__}: {str(e)[:200]}"
            torch_cp.gqa[be] = good
            msg = how if good else f"KV heads repeated {args.heads // args.kv_heads}x ({how})"
            note(f"torch_cp_gqa_{be}", msg)
            ctx.log(f"torch CP ({be}) GQA: {msg}")
    if te is not None and te.reason is None:
        note("transformer_engine", te.version)
    if ulysses is not None and ulysses.reason is None:
        note("deepspeed", f"{ulysses.version} (forward takes batch_dim_idx: {ulysses.takes_batch_dim})")
    return Peers(torch_cp, te, ulysses)
