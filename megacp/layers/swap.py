"""Swapping a model's attention for CP attention, keeping its module tree and checkpoint keys."""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist
from torch import nn

from megacp.layers.attention import DotProductAttention
from megacp.layers.cp_attention import CPDotProductAttention
from megacp.layers.settings import CPSettings
from megacp.parallel.ring import Ring
from megacp.parallel.state import ParallelState


class TECPDotProductAttention(CPDotProductAttention):
    """CP attention replacing a Transformer Engine module: keeps TE's ``_extra_state`` checkpoint
    entry (FP8 metadata, empty outside FP8) so that TE checkpoints still load and save."""

    def __init__(self, *args: Any, extra_state: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._te_extra_state = extra_state

    def get_extra_state(self) -> Any:
        return self._te_extra_state

    def set_extra_state(self, state: Any) -> None:
        self._te_extra_state = state


def _te_attention_class() -> type | None:
    try:
        import transformer_engine.pytorch as te
    except Exception:  # TE absent or unusable on this machine (no GPU)
        return None
    return te.DotProductAttention


def settings_for(state: Any = None, strategy: str | None = None) -> CPSettings:
    """The CP settings of ``state``: a :class:`~megacp.layers.settings.CPSettings` as it is, a
    :class:`megacp.ParallelState` (its ring and configured sections), a CP process group (a ring over
    it, default options) or ``None`` (the whole world when torch.distributed is initialised, else
    CP = 1); ``strategy`` overrides the prefill strategy."""
    if isinstance(state, CPSettings):
        settings = state
    elif isinstance(state, ParallelState):
        settings = CPSettings.from_state(state)
    elif state is None or isinstance(state, dist.ProcessGroup):
        settings = CPSettings(ring=Ring(state) if dist.is_initialized() else None)
    else:
        raise TypeError(f"swap_attention needs CPSettings, a ParallelState, a process group or None, got {type(state).__name__}")
    return settings.replace(prefill=strategy) if strategy is not None else settings


def _first_attr(mod: nn.Module, *names: str) -> Any:
    for name in names:
        if getattr(mod, name, None) is not None:
            return getattr(mod, name)
    raise AttributeError(f"{type(mod).__name__} has none of the attributes {', '.join(names)}")


def _convert(mod: Any, settings: CPSettings, te_cls: Any) -> CPDotProductAttention:
    if te_cls is not None and isinstance(mod, te_cls):
        head_dim = _first_attr(mod, "hidden_size_per_attention_head_k", "hidden_size_per_attention_head", "kv_channels")
        heads = getattr(mod, "num_attention_heads", None) or _first_attr(mod, "hidden_size_per_partition") // head_dim
        dropout = getattr(mod, "attention_dropout", 0.0)
        return TECPDotProductAttention(
            num_attention_heads=heads,
            kv_channels=head_dim,
            num_gqa_groups=mod.num_gqa_groups,
            attention_dropout=dropout if isinstance(dropout, (int, float)) else 0.0,
            qkv_format=mod.qkv_format,
            attn_mask_type=mod.attn_mask_type,
            layer_number=mod.layer_number,
            softmax_scale=mod.softmax_scale,
            window_size=getattr(mod, "window_size", None),
            settings=settings,
            extra_state=mod.get_extra_state(),
        )
    return CPDotProductAttention(
        mod.num_attention_heads, mod.kv_channels, mod.num_gqa_groups, mod.attention_dropout,
        qkv_format=mod.qkv_format, attn_mask_type=mod.attn_mask_type, layer_number=mod.layer_number,
        softmax_scale=mod.softmax_scale, window_size=mod.window_size, settings=settings,
    )


def swap_attention(model: nn.Module, state: Any = None, *, strategy: str | None = None) -> list[str]:
    """Replace each attention core of ``model`` by a CP attention layer, in place.

    Swaps every ``transformer_engine.pytorch.DotProductAttention`` and every
    :class:`megacp.layers.attention.DotProductAttention`; module names, parameters and each
    module's training/eval mode are unchanged.

    Args:
        model: any ``nn.Module``.
        state: the layers' CP settings, or what :func:`settings_for` builds them from (a
            :class:`megacp.ParallelState`, a CP process group, ``None``).
        strategy: the prefill strategy of the steps the new layers plan themselves (default:
            the settings').

    Returns:
        The qualified names of the swapped modules. Warns when there was nothing to swap. Every
        replacement is built before any is put in place: a module that cannot be swapped (e.g. a
        non-causal mask) raises and leaves the model unchanged.
    """
    settings = settings_for(state, strategy)
    te_cls = _te_attention_class()
    kinds: tuple[Any, ...] = (DotProductAttention,) + ((te_cls,) if te_cls is not None else ())
    targets: list[tuple[str, nn.Module]] = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, kinds) and not isinstance(mod, CPDotProductAttention)]
    replacements = [_convert(mod, settings, te_cls).train(mod.training) for _, mod in targets]
    for (name, _), new in zip(targets, replacements):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    if not targets:
        warnings.warn(
            f"swap_attention found no DotProductAttention (TE or megacp) in {type(model).__name__}; nothing was swapped",
            stacklevel=2,
        )
    return [name for name, _ in targets]
