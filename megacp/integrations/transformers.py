"""megacp's CP attention inside any Hugging Face transformers causal LM (``attn_implementation="megacp"``).

Importing this module registers :func:`megacp_attention` with ``transformers.AttentionInterface``
and :func:`megacp_mask` with ``transformers.AttentionMaskInterface`` under the name ``"megacp"``
(``import megacp`` arranges that lazily, see :mod:`megacp.integrations`). Then::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="megacp")
    batch = prepare_batch(input_ids, state=state)          # this CP rank's load-balanced share
    loss = model(**batch).loss                             # ring prefill + fused ring backward

The model's own modules compute q/k/v and RoPE (at the global positions of this rank's tokens,
which :func:`prepare_batch` passes as ``position_ids``); the attention function receives them as
``[B, H, S_local, D]``, converts to megacp's packed ``[tokens, H, D]`` and runs the
step :func:`prepare_batch` built (``megacp_step``) through its ``attend``: the same ring prefill, strategy rule, kernels and differentiable pass-KV
ring as megacp's own models, with the module's ``sliding_window`` (transformers passes it per layer:
Mistral, Qwen2's windowed layers, Gemma-style alternation) planned as in megacp's layers. Without a step the call is CP = 1 attention over this process's tokens
(documents from ``cu_seq_lens_q`` or from position-id resets, else one per batch row).

A model is computed by megacp's attention in every layer or refused: an architecture whose attention
bypasses transformers' attention interface or drops the model's arguments on the way (Falcon, BLOOM,
MPT, GPT-Neo, state-space hybrids) is refused by :func:`check_model` from its class, by
:func:`megacp_mask` at its first forward, and by :func:`verify_attention_calls`, a dry forward that
counts the calls that carried megacp's step (what megacp's loaders and :class:`~megacp.integrations.
hf_trainer.CPTrainer` run before any work). What megacp cannot reproduce exactly is refused with one
``ValueError`` naming the model's feature
(:func:`check_model` before any work; :func:`megacp_attention` at every call): non-causal
attention, attention-logit soft-capping, ALiBi, attention sinks, custom 4-D or padding masks, attention dropout in training, a cache holding past tokens
(generation keeps them in megacp's CP-sharded cache: :mod:`megacp.integrations.hf_generate`),
returned attention weights, and any attention argument this module does not know.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from megacp.attention.preconditions import agree, content_digest
from megacp.layers.settings import CPSettings
from megacp.layers.step import CPStep, cacheless_step, plan_step
from megacp.placement.batch import TrainShard, shard_batch

NAME = "megacp"
"""The ``attn_implementation`` name."""

STEP_KWARG = "megacp_step"
"""Keyword of the model's forward that carries the :class:`CPStep` down to every attention call."""

_PASSIVE_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_hidden_states", "output_router_logits",
    "num_items_in_batch", "shift_labels", "return_dict", "position_embeddings", "seq_idx",
})
"""Arguments transformers hands every attention function that do not change attention (RoPE is
already applied; loss arguments travel with the model's ``**kwargs``)."""

_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""transformers' packed-document arguments (whole-document boundaries of this process's tokens)."""


def _label(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None) or type(module).__name__
    layer = getattr(module, "layer_idx", None)
    return f"{model_type} layer {layer}" if layer is not None else str(model_type)


def config_problem(config: Any) -> str | None:
    """Why megacp's attention cannot run a model of this ``transformers`` config exactly, or ``None``.

    Checks what a config states for every layer (each call checks the arguments its layer passes):
    bidirectional attention, soft-capping, ALiBi, attention dropout.
    """
    kind = getattr(config, "model_type", "model")
    if getattr(config, "is_causal", True) is False or getattr(config, "use_bidirectional_attention", False):
        return f"{kind} uses bidirectional (non-causal) attention; megacp's CP attention is causal only"
    for key in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, key, None):
            return f"{kind} soft-caps attention logits ({key}={getattr(config, key)}); megacp's kernels have no soft-capping"
    if any(getattr(config, key, False) for key in ("alibi", "use_alibi")) or getattr(config, "position_embedding_type", None) == "alibi":
        return f"{kind} uses ALiBi position biases; megacp's kernels take no attention bias"
    return None


def _interface_problem(model_class: type, config: Any) -> str | None:
    """Why a model class cannot run under megacp because its attention bypasses transformers'
    attention interface (or drops the arguments megacp's step travels in), or ``None``.

    transformers marks the classes whose attention modules call the registered attention function
    with the model's keyword arguments passed through as ``_supports_attention_backend``; the others
    (Falcon, BLOOM, MPT, GPT-Neo, the state-space hybrids …) compute attention in their own code, or
    call the interface without megacp's step, so under CP they would attend within each rank's shard.
    """
    if getattr(model_class, "_supports_attention_backend", False):
        return None
    kind = getattr(config, "model_type", None) or model_class.__name__
    return (f"{model_class.__name__} ({kind}) computes attention in its own modules, not through transformers' "
            "attention interface with the model's arguments passed on: megacp cannot run it exactly")


def _causal_lm_class(config: Any) -> type | None:
    """The transformers causal-LM class of a config (``None``: not one transformers maps)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def check_config_architecture(config: Any) -> None:
    """Refuse, in one line, a config whose causal-LM class computes attention its own way
    (:func:`_interface_problem`); configs transformers maps to no causal-LM class pass (their model
    is checked by :func:`check_model` and :func:`verify_attention_calls`).

    Raises:
        ValueError: naming the class and model type.
    """
    model_class = _causal_lm_class(config)
    problem = None if model_class is None else _interface_problem(model_class, config)
    if problem is not None:
        raise ValueError(problem)


def without_adapters(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT ``PeftModel`` (whose adapter layers PEFT put into that
    model's own modules), or ``model`` itself when it is not one."""
    if callable(getattr(type(model), "get_base_model", None)) and hasattr(model, "peft_config"):
        return model.get_base_model()  # type: ignore[operator]  # a peft.PeftModel
    return model


def check_model(model: nn.Module, *, training: bool | None = None) -> None:
    """Refuse, in one line, a model megacp's attention cannot run exactly, before any work (what its
    class and config state; :func:`verify_attention_calls` then runs it once).

    Args:
        model: a transformers ``PreTrainedModel`` (its ``config``), or a PEFT ``PeftModel`` of one
            (:func:`without_adapters`: the transformers model's class is checked).
        training: whether it will be trained (default: ``model.training``); attention dropout then
            counts.

    Raises:
        ValueError: naming the model's unsupported feature (:func:`config_problem`, an attention that
            bypasses the interface, dropout).
    """
    config: Any = getattr(model, "config", None)
    problem = config_problem(config) if config is not None else f"{type(model).__name__} has no transformers config"
    if problem is None:
        problem = _interface_problem(type(without_adapters(model)), config)
    training = model.training if training is None else training
    if problem is None and training and float(getattr(config, "attention_dropout", 0.0) or 0.0):
        problem = (f"{config.model_type} has attention_dropout={config.attention_dropout} and trains: megacp's "
                   "attention has no dropout; load it with attention_dropout=0.0")
    if problem is not None:
        raise ValueError(problem)


_PROBE: list[bool] | None = None
"""While :func:`verify_attention_calls` runs its dry forward: one entry per :func:`megacp_attention`
call, whether the call carried a megacp step."""


def verify_attention_calls(model: nn.Module) -> None:
    """Run the model once on two tokens (CP = 1, no gradients, eval mode, no cache) and check that
    every decoder layer's attention went through :func:`megacp_attention` with the step of
    :func:`prepare_batch`: a model is either computed by megacp's attention everywhere, or refused.

    The model must already use ``attn_implementation="megacp"``; it runs where its parameters are.

    Raises:
        ValueError: one line naming the architecture: its forward failed under megacp's attention,
            a layer's attention did not call it, or a call lost the step (its modules drop the
            model's keyword arguments).
    """
    global _PROBE
    config: Any = getattr(model, "config", None)
    name = type(without_adapters(model)).__name__
    layers = getattr(config, "num_hidden_layers", None)
    device = next(model.parameters()).device
    inputs = prepare_batch(torch.tensor([[0, min(1, int(getattr(config, "vocab_size", 2)) - 1)]]), training=False)
    for key in ("labels", "shift_labels", "num_items_in_batch"):
        inputs.pop(key)
    inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
    was_training, _PROBE = model.training, []
    try:
        model.eval()
        with torch.no_grad():
            model(**inputs)
    except Exception as err:  # noqa: BLE001 - any failure of the dry forward refuses the model
        if isinstance(err, ValueError) and "megacp" in str(err):
            raise  # megacp's own one-line refusal of a feature
        raise ValueError(f"{name} fails under megacp's attention ({type(err).__name__}: {err}); megacp cannot run it") from None
    finally:
        calls, _PROBE = _PROBE, None
        model.train(was_training)
    with_step = sum(calls)
    if layers is not None and with_step != layers or with_step == 0 or with_step != len(calls):
        where = f"{with_step} of its {layers} layers" if layers is not None else f"{with_step} attention calls"
        raise ValueError(f"{name}: only {where} reached megacp's attention with the model's arguments "
                         f"({len(calls)} calls in all): its modules compute or call attention their own way, "
                         "so megacp cannot run it exactly")


def _call_problem(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Any, dropout: float,
                  is_causal: bool | None, kwargs: dict[str, Any]) -> str | None:
    """Why this attention call cannot run exactly under megacp, or ``None``."""
    what = _label(module)
    config = getattr(module, "config", None)
    problem = config_problem(config) if config is not None else None
    if problem is not None:
        return problem
    if is_causal is False or getattr(module, "is_causal", True) is False:
        return f"{what} asks for non-causal attention; megacp's CP attention is causal only"
    if dropout:
        return f"{what} applies attention dropout {dropout} (training mode); megacp's attention has no dropout: set attention_dropout=0.0"
    if kwargs.get("softcap"):
        return f"{what} soft-caps attention logits (softcap={kwargs['softcap']}); megacp's kernels have no soft-capping"
    window = kwargs.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < 1):
        return f"{what} passes sliding_window={window!r}; megacp takes a window of at least 1 token"
    if kwargs.get("output_attentions"):
        return f"{what} was asked for attention weights (output_attentions); megacp's attention does not form them"
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
            shape = f"{attention_mask.dim()}-D " if isinstance(attention_mask, Tensor) else ""
            return (f"{what} got a custom {shape}attention mask ({type(attention_mask).__name__}); megacp attends causally "
                    "within documents: delimit them with position_ids or cu_seq_lens")
        if not bool(attention_mask.all()):
            return f"{what} got a padding attention mask; megacp packs documents instead: use prepare_batch or position_ids"
    if key.shape[-2] != query.shape[-2]:
        return (f"{what} attends over {key.shape[-2]} keys for {query.shape[-2]} queries (a transformers cache with past "
                "tokens); generate through megacp.LLM, or call the model with use_cache=False")
    unknown = sorted(k for k, v in kwargs.items()
                     if v is not None and k not in _PASSIVE_KWARGS and k not in _VARLEN_KWARGS
                     and k not in ("softcap", "sliding_window", "output_attentions"))
    if unknown:
        return f"{what} passes attention arguments megacp does not implement: {', '.join(unknown)}"
    return None


def _documents(query: Tensor, kwargs: dict[str, Any]) -> list[int]:
    """Document lengths of a step-less (CP = 1) call: ``cu_seq_lens_q``, else position-id resets of
    a single packed row, else one document per batch row."""
    b, s = query.shape[0], query.shape[2]
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        bounds = [int(x) for x in cu.flatten().tolist()]
        if bounds[0] != 0 or bounds[-1] != b * s or any(y <= x for x, y in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seq_lens_q {bounds} does not delimit the {b * s} tokens of the call")
        return [y - x for x, y in zip(bounds, bounds[1:])]
    pos = kwargs.get("position_ids")
    if pos is not None and b == 1:
        starts = [0] + [i for i in (torch.nonzero(pos.reshape(-1)[1:] == 0).flatten() + 1).tolist()] + [s]
        return [y - x for x, y in zip(starts, starts[1:])]
    return [s] * b


def megacp_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                     dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                     **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function contract, computed by megacp's CP attention.

    Args:
        module: the calling attention module (``config``, ``layer_idx``, ``is_causal``).
        query: ``[B, Hq, S, D]`` after RoPE; key, value: ``[B, Hkv, S, D]`` (GQA: ``Hq % Hkv == 0``).
            Under CP these are this rank's tokens, batch-major, in the step's ``q_layout`` order.
        attention_mask: what :func:`megacp_mask` built (``None``), or a mask handed in as it is.
        dropout, scaling, is_causal: as the module passes them (``scaling``: softmax scale, default
            ``D**-0.5``).
        kwargs: :data:`STEP_KWARG` (the :class:`CPStep` of :func:`prepare_batch`), transformers'
            varlen arguments, and what models pass through.

    Returns:
        ``(out [B, S, Hq, D] in query's dtype, None)``.

    Raises:
        ValueError: one line naming the unsupported feature of the model or the call.
    """
    step = kwargs.pop(STEP_KWARG, None)
    if _PROBE is not None:
        _PROBE.append(step is not None)
    if step is not None and not isinstance(step, CPStep):
        raise TypeError(f"{STEP_KWARG} must be a megacp CPStep (from prepare_batch), got {type(step).__name__}")
    b, hq, s, d = query.shape
    lengths = [c + n for c, n in zip(step.plan.cached, step.plan.new)] if step is not None else _documents(query, kwargs)
    problem = _call_problem(module, query, key, attention_mask, dropout, is_causal, kwargs)
    if problem is not None:
        raise ValueError(problem)
    q, k, v = (x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (query, key, value))
    if step is None:
        step = cacheless_step(CPSettings(), q, k, v, lengths)
    layer, window = _Layer(getattr(module, "layer_idx", None) or 0), kwargs.get("sliding_window")
    if b * s == 1 and step.token_index().numel() == 0:  # the placeholder row of a rank without tokens
        return step.attend(layer, q[:0], k[:0], v[:0], scaling, window).new_zeros(b, s, hq, d), None
    out = step.attend(layer, q, k, v, scaling, window)
    return out.view(b, s, hq, d), None


@dataclasses.dataclass(frozen=True)
class _Layer:
    """The calling module as a step sees it (:class:`~megacp.layers.step.AttentionLayer`)."""

    layer_index: int


def megacp_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Any = None, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """transformers' mask-function contract for ``"megacp"``: no dense mask is ever built (the
    plan says which tokens see which); a 2-D padding mask with padding is passed on for
    :func:`megacp_attention` to refuse. Returns ``None`` or that ``[B, kv_length]`` bool mask.

    Every forward builds its mask first, so a model whose attention bypasses the interface (its
    causal-LM class, from ``config``) is refused here, before any layer runs.

    Raises:
        ValueError: the model's attention does not go through the interface (one line).
    """
    config = kwargs.get("config")
    if config is not None:
        check_config_architecture(config)
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
    return attention_mask


def _documents_of_rows(input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, list[int]]:
    """``[B, S]`` rows (right- or left-padded where ``attention_mask`` is 0) -> packed ``[T]`` ids
    of their real tokens and the rows' lengths."""
    if attention_mask is None:
        return input_ids.reshape(-1), [input_ids.shape[1]] * input_ids.shape[0]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {list(attention_mask.shape)} must match input_ids {list(input_ids.shape)}")
    keep = attention_mask.bool()
    lengths = [int(n) for n in keep.sum(1).tolist()]
    if min(lengths) < 1:
        raise ValueError("every row of the batch needs at least one token that attention_mask keeps")
    return input_ids[keep], lengths


def prepare_batch(input_ids: Tensor, *, labels: Tensor | None = None, position_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None, cu_seqlens: Tensor | Sequence[int] | None = None,
                  state: Any = None, cp_size: int | None = None, cp_rank: int | None = None,
                  training: bool = True) -> dict[str, Any]:
    """This CP rank's share of a batch, as keyword arguments of a transformers causal LM's forward.

    Every rank of a CP group passes the same batch (checked with a state: a digest of each input in
    one small all-gather, a mismatch is one ``ValueError`` on every rank). Documents are the rows of a ``[B, S]`` batch
    (without the tokens ``attention_mask`` pads), or the documents of one packed row: given by
    ``cu_seqlens``, else by the resets of ``position_ids`` to 0 (what transformers'
    ``DataCollatorWithFlattening`` produces). Labels (unshifted, ``-100`` ignored; default the
    inputs) are shifted per document *before* sharding; everything is then sharded with the
    load-balanced plan of :func:`megacp.placement.batch.shard_batch`.

    Args:
        input_ids: ``[B, S]`` or ``[T]`` int64; labels, position_ids: the same shape.
        attention_mask: ``[B, S]`` 1 = token, 0 = padding (dropped).
        cu_seqlens: ``[D+1]`` document boundaries of a packed ``[1, T]``/``[T]`` batch.
        state: a :class:`megacp.ParallelState` (its CP settings, :meth:`CPSettings.from_state`), or
            ``None`` with ``cp_size``/``cp_rank`` (``None``: CP = 1).
        training: a differentiable :class:`~megacp.layers.step.TrainStep` (default), else an
            inference prefill step.

    Returns:
        ``input_ids``, ``position_ids`` (global positions of this rank's tokens, for RoPE),
        ``labels`` and ``shift_labels`` (both the shifted targets, ``[1, n_local]``),
        ``num_items_in_batch`` (valid labels of the whole sequence group: each rank's loss is its
        share of the group's mean), ``use_cache=False`` and :data:`STEP_KWARG`.

    Raises:
        ValueError: one line naming the bad input.
    """
    cp_size, cp_rank = (state.size("cp"), state.rank_in("cp")) if state is not None else (cp_size or 1, cp_rank or 0)
    if state is not None and cp_size > 1:  # one small all-gather: the CP ranks must shard the same batch
        given = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "attention_mask": attention_mask,
                 "cu_seqlens": None if cu_seqlens is None else torch.as_tensor(cu_seqlens)}
        fields: list[tuple[str, object]] = []
        for name, t in given.items():
            fields += [(f"{name} shape", [-1] if t is None else list(t.shape)),
                       (name, content_digest(t) if t is not None else 0)]
        agree(CPSettings.from_state(state).ring, fields, device=state.device, what="prepare_batch")
    if input_ids.dim() == 2 and cu_seqlens is None and not (input_ids.shape[0] == 1 and position_ids is not None):
        if position_ids is not None:
            raise ValueError("position_ids of a [B, S] batch with B > 1: pack the documents into one row instead")
        ids, lengths = _documents_of_rows(input_ids, attention_mask)
        labels = None if labels is None else _documents_of_rows(labels, attention_mask)[0]
        cu_seqlens = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    else:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask with padding in a packed batch: drop the padding tokens instead")
        ids = input_ids.reshape(-1)
        labels = None if labels is None else labels.reshape(-1)
        if position_ids is not None:
            position_ids = position_ids.reshape(-1)
            if cu_seqlens is None:
                starts = (torch.nonzero(position_ids[1:] == 0).flatten() + 1).tolist()
                cu_seqlens = [0, *starts, ids.numel()]
    shard = shard_batch(ids, labels, cu_seqlens=cu_seqlens, position_ids=position_ids, cp_size=cp_size,
                        cp_rank=cp_rank)
    return model_inputs(shard, CPSettings.from_state(state) if state is not None else None, training=training)


def model_inputs(shard: TrainShard, settings: CPSettings | None = None, *, training: bool = True) -> dict[str, Any]:
    """A :class:`~megacp.placement.batch.TrainShard` as keyword arguments of a transformers causal LM's
    forward (what :func:`prepare_batch` returns; ``[1, n_local]`` tensors on the shard's device).

    Args:
        shard: this rank's share (its plan's CP size must be the state's).
        settings: the CP settings the step runs with (``None``: CP = 1).
        training: a :class:`~megacp.layers.step.TrainStep`, else a prefill step (``"auto"`` resolves
            to pass-KV: a prefill without cached tokens, the paper's rule).
    """
    settings = settings or CPSettings()
    if settings.cp_size != shard.plan.cp_size:
        raise ValueError(f"the shard is for {shard.plan.cp_size} CP ranks but the CP group has {settings.cp_size}")
    if not training and settings.prefill == "auto":
        settings = dataclasses.replace(settings, prefill="pass_kv")
    step = plan_step(settings, shard.plan, training=training)
    shifted = shard.labels.unsqueeze(0)
    return {
        "input_ids": shard.input_ids.unsqueeze(0),
        "position_ids": shard.position_ids.unsqueeze(0),
        "labels": shifted,
        "shift_labels": shifted,
        "num_items_in_batch": max(shard.num_valid_tokens, 1),
        "use_cache": False,  # the tokens are a CP shard: generation keeps its cache in megacp's
        STEP_KWARG: step,
    }


def shard_loss(model: nn.Module, shard: TrainShard, *, settings: CPSettings | None = None) -> Tensor:
    """This CP rank's share of the batch's mean token loss from a transformers causal LM (its own
    LM head and loss function, labels pre-shifted, divided by the whole group's valid labels), the
    loss function :class:`megacp.train.engine.Trainer` takes for an HF-native model."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in model_inputs(shard, settings).items()}
    return model(**inputs).loss


def read_transformers_config(path: str) -> Any:
    """The transformers config of the model directory ``path`` (no weights read).

    Raises:
        CheckpointError: the directory has no config transformers can read (one line).
    """
    from transformers import AutoConfig

    from megacp.checkpoint.errors import CheckpointError

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: transformers cannot read its config ({str(err).splitlines()[0]})") from None


def check_mesh(state: Any) -> None:
    """Refuse a mesh that would split a transformers model: its modules run whole on every rank,
    under CP and DP only.

    Raises:
        ValueError: ``state``'s TP or PP size is above 1 (one line).
    """
    if state.size("tp") > 1 or state.size("pp") > 1:
        raise ValueError("a transformers model runs under CP and DP only: tensor and pipeline parallel sizes must be 1")


def load_pretrained(path: str, *, dtype: torch.dtype, state: Any = None, activation_checkpointing: bool = False,
                    training: bool = True) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, attn_implementation="megacp")`` on the state's
    device, checked by :func:`check_model` (one line on an unsupported feature, before training).

    Args:
        path: a Hugging Face model directory; dtype: of the parameters.
        state: the :class:`megacp.ParallelState` (its device; the transformers family has checked
            that it splits nothing over TP or PP ranks: :func:`check_mesh`); ``None``: CPU, CP = 1.
        activation_checkpointing: transformers' non-reentrant gradient checkpointing of every
            decoder layer (the recompute runs the CP ring again).
        training: whether the model will be trained (attention dropout is refused then).
    """
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, attn_implementation=NAME, dtype=dtype)
    check_model(model, training=training)
    model = model.to(state.device if state is not None else "cpu")
    verify_attention_calls(model)  # on the device it will run on
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train(training)


def save_pretrained(model: nn.Module, directory: str, *, tokenizer: Any = None) -> None:
    """Global rank 0 writes ``model.save_pretrained(directory)`` (and the tokenizer's files); the
    others wait (collective when torch.distributed is initialised). Every rank holds the whole
    model (ZeRO <= 2): no gathering needed."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(directory)  # type: ignore[operator]  # a transformers PreTrainedModel
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()


def register() -> None:
    """Register ``"megacp"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, megacp_attention)
    AttentionMaskInterface.register(NAME, megacp_mask)


register()
