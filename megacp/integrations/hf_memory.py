"""Long-sequence training memory for any transformers causal LM that runs under megacp's attention:
sequence-tiled MLPs, decoder-layer inputs checkpointed on the device or in host memory, and the
LM head + loss over chunks of tokens (never the ``S x vocab`` logits).

The same features megacp's own models have (:mod:`megacp.models.tiling`,
:mod:`megacp.models.checkpointing`, :func:`megacp.models.lm_head.chunked_cross_entropy`), applied to the
modules transformers builds:

* :func:`fuse_norms`: every RMSNorm whose forward is Llama's formula runs as one fused kernel
  (:func:`~megacp.models.ops.rms_norm`, bitwise equal): its fp32 copies of the input are neither
  made nor kept for the backward;
* :func:`tile_mlps`: each decoder layer's ``mlp`` (any token-wise module ``[B, S, H] -> [B, S, H]``)
  runs over tiles of ``tile`` tokens (:func:`tiled_tokenwise`): the forward without autograd, the
  backward recomputing one tile at a time, so the MLP's working set is O(tile) instead of O(S) —
  what DeepSpeed's ``TiledMLP`` does for ALST;
* :func:`checkpoint_layers`: every decoder layer (or block of layers: a second checkpoint level) keeps
  only its input ``hidden_states`` for the backward (:func:`~megacp.models.checkpointing.checkpoint_layer`),
  optionally in pinned host memory (a :class:`~megacp.models.checkpointing.HostStash`, copied out and
  back on a side stream), as the :class:`LayerCheckpoints` it returns say;
* :func:`tiled_loss`: the base model's final hidden states times the output embedding, chunk by
  chunk (:func:`~megacp.models.lm_head.chunked_cross_entropy`), for heads that are a plain matrix
  (Granite's ``logits_scaling`` and Cohere's ``logit_scale`` folded in); :func:`check_tiled_loss`
  compares it once with the model's own loss, so a head that transforms its logits otherwise is
  trained by the model's own loss instead of a wrong one.

Each leaves the loss and every gradient unchanged (fp32: to rounding). :func:`apply_memory` applies
them from the memory options; where those say ``"auto"``, megacp's memory plan
(:mod:`megacp.train.memory`, reading :func:`plan_config`) sets the tiles, the checkpoint blocks and
the offloaded blocks per step through the returned :class:`HFMemory`, as it does for megacp's own
models.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from megacp.config import ConfigError, MemoryOptions
from megacp.layers.step import TrainStep
from megacp.models.checkpointing import HostStash, SelfCheckpointed, checkpoint_block, checkpoint_layer
from megacp.models.config import ModelConfig
from megacp.models.lm_head import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from megacp.models.ops import rms_norm
from megacp.models.tiled_layer import TiledLayer, tiled_layer
from megacp.placement.batch import TrainShard


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.get_decoder().layers``).

    Raises:
        ValueError: the model has no such list (one line naming its class).
    """
    get = getattr(model, "get_decoder", None)
    layers = getattr(get(), "layers", None) if callable(get) else None
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"{type(model).__name__} has no decoder layer list (get_decoder().layers) for megacp's "
                         "tiling and checkpointing")
    return layers


def num_experts(config: Any) -> int:
    """Routed experts of a transformers config (a ``PretrainedConfig`` or ``config.json`` as a dict;
    0: a dense model)."""
    read = config.get if isinstance(config, dict) else lambda key: getattr(config, key, 0)
    return int(read("num_experts") or read("num_local_experts") or 0)


class _TiledTokenwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, run: Callable[[Tensor], Tensor], tile: int, *params: Tensor) -> Tensor:
        with torch.no_grad():
            y = torch.cat([run(x[:, a:a + tile]) for a in range(0, x.shape[1], tile)], dim=1)
        ctx.save_for_backward(x)
        ctx.run, ctx.tile, ctx.params = run, tile, params  # the parameters themselves, read again in backward
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        wants = ctx.needs_input_grad[3:]
        wanted = [p for p, want in zip(ctx.params, wants) if want]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        sums: list[Tensor | None] = [None] * len(wanted)
        dy = dy.contiguous()
        for a in range(0, x.shape[1], ctx.tile):
            with torch.enable_grad():
                xt = x[:, a:a + ctx.tile].detach().requires_grad_(dx is not None)
                yt = ctx.run(xt)
            inputs = ([xt] if dx is not None else []) + wanted
            grads = list(torch.autograd.grad(yt, inputs, dy[:, a:a + ctx.tile], allow_unused=True))
            if dx is not None:
                dx[:, a:a + ctx.tile] = grads.pop(0)
            for i, g in enumerate(grads):
                if g is not None:
                    s = sums[i]
                    sums[i] = g.to(torch.promote_types(g.dtype, torch.float32)) if s is None else s.add_(g)
        summed = iter(sums)
        out = [(next(summed) if want else None) for want in wants]
        return (dx, None, None, *(s.to(p.dtype) if s is not None else None for s, p in zip(out, ctx.params)))


class _TiledPartitioned(torch.autograd.Function):
    """:class:`_TiledTokenwise` for parameters ZeRO 3 partitions: they are no inputs of the function
    (ZeRO 3 gathers them only around each projection's call, so their recorded shapes would be the
    empty partitions); the backward recomputes each tile through the module's own calls and
    back-propagates into the parameters' ``.grad``, telling DeepSpeed (``ds_grad_is_ready``, its
    protocol for tiled compute) that a parameter's gradient is complete only after the last tile (and
    only where an enclosing tiled computation does not hold it back: :mod:`megacp.models.tiled_layer`).
    Every rank cuts the same number of tiles (:func:`_common_tiles`; some may be empty), so that their
    weight gathers pair up."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, run: Callable[[Tensor], Tensor], tiles: int, params: list[Tensor]) -> Tensor:
        with torch.no_grad():
            y = torch.cat([run(t) for t in torch.tensor_split(x, tiles, dim=1)], dim=1)
        ctx.save_for_backward(x)
        ctx.run, ctx.tiles, ctx.params = run, tiles, [p for p in params if p.requires_grad]
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        wants_dx = ctx.needs_input_grad[0]
        grads = []
        # an enclosing tiled computation (a layer over query tiles) may hold the gradients back itself
        outer = [getattr(p, "ds_grad_is_ready", True) for p in ctx.params]
        for n, (xt, dyt) in enumerate(zip(torch.tensor_split(x, ctx.tiles, dim=1),
                                          torch.tensor_split(dy.contiguous(), ctx.tiles, dim=1))):
            for p, ready in zip(ctx.params, outer):
                p.ds_grad_is_ready = ready and n == ctx.tiles - 1
            with torch.enable_grad():
                xt = xt.detach().requires_grad_(wants_dx)
                yt = ctx.run(xt)
            torch.autograd.backward(yt, dyt)
            grads.append(xt.grad)
        for p, ready in zip(ctx.params, outer):
            p.ds_grad_is_ready = ready
        return (torch.cat(grads, dim=1) if wants_dx else None), None, None, None  # type: ignore[arg-type]


def _common_tiles(tokens: int, tile: int, device: torch.device) -> int:
    """How many tiles every rank cuts its ``tokens`` into: enough for the rank with the most (ZeRO 3
    gathers a projection's weights in a collective at each call, so every rank must call as often)."""
    import torch.distributed as dist

    count = torch.tensor([max(-(-tokens // tile), 1)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


@dataclass
class Tiling:
    """The sequence tiling of a model's MLPs (what :func:`tile_mlps` returns).

    Attributes:
        tile: tokens per tile (0: the MLPs run untiled; a memory plan may set it per step).
        step_tokens: the most tokens any rank's MLP call holds in the current step, set by the trainer
            before each micro-batch (under ZeRO 3 every rank must cut as many tiles: with it they agree
            without a collective; ``None``: they agree through one small all-reduce per call).
    """

    tile: int
    step_tokens: int | None = None

    def tiles(self, tokens: int, device: torch.device) -> int:
        """The number of tiles every rank cuts under ZeRO 3 (:func:`_common_tiles` when unset)."""
        if self.step_tokens is not None:
            return max(-(-self.step_tokens // self.tile), 1)
        return _common_tiles(tokens, self.tile, device)


def tiled_tokenwise(module: nn.Module, run: Callable[[Tensor], Tensor], x: Tensor, tiling: Tiling | int) -> Tensor:
    """``run(x)`` of a token-wise ``run`` (each token's output depends on that token's input only)
    over tiles of ``tile`` tokens of ``x [B, S, H]`` -> ``[B, S, H]``, keeping only ``x`` for the
    backward, which recomputes one tile at a time; the gradients of ``module``'s parameters (those
    ``run`` uses) are summed over the tiles in at least fp32 and handed back once, so a training
    engine's gradient hooks fire once per parameter, as untiled.

    Raises:
        ValueError: ``tile < 1``.
    """
    tiling = tiling if isinstance(tiling, Tiling) else Tiling(tiling)
    tile = tiling.tile
    if tile < 1:
        raise ValueError(f"tile must be at least 1 token; got {tile}")
    params = list(module.parameters())
    grads = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    if any(hasattr(p, "ds_id") for p in params):  # partitioned by ZeRO 3: as many tiles on every rank
        tiles = tiling.tiles(x.shape[1], x.device)
        if not grads:
            return torch.cat([run(t) for t in torch.tensor_split(x, tiles, dim=1)], dim=1)
        return _TiledPartitioned.apply(x, run, tiles, params)
    if not grads:
        return torch.cat([run(x[:, a:a + tile]) for a in range(0, x.shape[1], tile)], dim=1)
    return _TiledTokenwise.apply(x, run, tile, *params)


def tile_mlps(model: nn.Module, tile: int) -> Tiling:
    """Run every decoder layer's ``mlp`` over sequence tiles of ``tile`` tokens (:func:`tiled_tokenwise`;
    0: untiled until the returned :class:`Tiling`'s ``tile`` is set, as a memory plan does per step).

    Returns:
        The :class:`Tiling` the MLPs read (a trainer sets its ``step_tokens``).

    Raises:
        ValueError: ``tile < 0``; a mixture-of-experts model (its router's outputs are recorded per
            call); a layer without an ``mlp`` module.
    """
    if tile < 0:
        raise ValueError(f"sequence_tiling.mlp must be at least 0 tokens; got {tile}")
    config = getattr(model, "config", None)
    if num_experts(config):
        raise ValueError(f"sequence_tiling.mlp: {type(model).__name__} is a mixture of experts, whose routers "
                         "megacp does not tile; set sequence_tiling.mlp to 0")
    tiling = Tiling(tile)
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(f"sequence_tiling.mlp: {type(layer).__name__} has no mlp module to tile")
        original = mlp.forward

        def forward(x: Tensor, _mlp: nn.Module = mlp, _run: Callable[[Tensor], Tensor] = original) -> Tensor:
            return _run(x) if tiling.tile == 0 else tiled_tokenwise(_mlp, _run, x, tiling)

        mlp.forward = forward  # called through the module (its hooks fire)
    return tiling


def _llama_layer_forward() -> str | None:
    """The source of transformers' ``LlamaDecoderLayer.forward`` (``None`` where it cannot be read)."""
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return inspect.getsource(LlamaDecoderLayer.forward)
    except (ImportError, OSError, TypeError):
        return None


def pre_norm_layer(layer: nn.Module) -> bool:
    """Whether a transformers decoder layer computes Llama's pre-norm formula —
    ``h = x + self_attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))`` — read from
    its class's forward, which must be Llama's line for line (Llama, Mistral, Qwen2, Qwen3 and the
    other families transformers generates from Llama's layer). Only such layers run their attention
    over query tiles (:func:`tile_attention`)."""
    reference = _llama_layer_forward()
    try:
        return reference is not None and inspect.getsource(type(layer).forward) == reference
    except (OSError, TypeError):
        return False


@dataclass
class AttentionTiling:
    """The query tiling of a model's decoder layers (what :func:`tile_attention` returns).

    Attributes:
        tile: local rows per tile (0: untiled; a memory plan may set it per step).
        layers: the decoder layers that can run tiled (:func:`pre_norm_layer`); the others run as
            transformers wrote them.
    """

    tile: int
    layers: int = 0


def tile_attention(model: nn.Module, tile: int) -> AttentionTiling:
    """Train every decoder layer that computes Llama's pre-norm formula (:func:`pre_norm_layer`)
    over query tiles of ``tile`` local rows (:func:`~megacp.models.tiled_layer.tiled_layer`: its
    attention module's own code per tile, K/V projected once per pass, only the layer input kept),
    in training steps whose ranks hold more than ``tile`` tokens; 0: untiled until the returned
    :class:`AttentionTiling`'s ``tile`` is set. Layers of another formula run as before.

    Raises:
        ValueError: ``tile < 0``.
    """
    from megacp.integrations.transformers import STEP_KWARG

    if tile < 0:
        raise ValueError(f"sequence_tiling.attention must be at least 0 tokens; got {tile}")
    tiling = AttentionTiling(tile)
    for layer in decoder_layers(model):
        if not pre_norm_layer(layer):
            continue
        tiling.layers += 1

        def tiled(args: tuple[Any, ...], kwargs: dict[str, Any], _layer: Any = layer) -> TiledLayer | None:
            step = kwargs.get(STEP_KWARG)
            if not (tiling.tile > 0 and torch.is_grad_enabled() and isinstance(step, TrainStep) and not args
                    and step.plan.max_local > tiling.tile):
                return None
            cos, sin = kwargs["position_embeddings"]
            position_ids = kwargs.get("position_ids")

            def sublayer(x: Tensor, tile_step: Any, rows: slice) -> Tensor:
                call = {**kwargs, STEP_KWARG: tile_step, "position_embeddings": (cos[:, rows], sin[:, rows]),
                        "attention_mask": None}
                if position_ids is not None:
                    call["position_ids"] = position_ids[:, rows]
                return _layer.self_attn(hidden_states=_layer.input_layernorm(x), **call)[0]

            def rest(h: Tensor) -> Tensor:
                return h + _layer.mlp(_layer.post_attention_layernorm(h))

            return TiledLayer(step, sublayer, rest, list(_layer.parameters()), tiling.tile, dim=1)

        original = layer.forward

        def forward(hidden_states: Tensor, *args: Any, _run: Callable[..., Tensor] = original,
                    _tiled: Callable[..., TiledLayer | None] = tiled, **kwargs: Any) -> Tensor:
            plan = _tiled(args, kwargs)
            return _run(hidden_states, *args, **kwargs) if plan is None else tiled_layer(plan, hidden_states)

        layer.forward = forward  # called through the module (its hooks fire)
        setattr(layer, "megacp_tiled", tiled)  # noqa: B010 - checkpoint_layers hands such a layer its stash
    return tiling


@dataclass
class LayerCheckpoints:
    """How :func:`checkpoint_layers` checkpoints a model's decoder layers (read at every forward, so
    a memory plan may change it per step).

    Attributes:
        layers_per_checkpoint: consecutive layers checkpointed as one block (> 1: a second level).
        offloaded_layers: the first layers of the blocks whose inputs wait in ``stash``'s host memory
            (the others' stay on the device).
        stash: the pinned host memory of the offloaded inputs (``None``: nothing is offloaded).
    """

    layers_per_checkpoint: int = 1
    offloaded_layers: frozenset[int] = frozenset()
    stash: HostStash | None = None


def checkpoint_layers(model: nn.Module, checkpoints: LayerCheckpoints) -> LayerCheckpoints:
    """Checkpoint the decoder layers in blocks of ``checkpoints.layers_per_checkpoint``: only a
    block's input ``hidden_states`` is kept for the backward (in the stash's host memory for the
    blocks in ``offloaded_layers``, else on the device), and the block runs again there (more than
    one layer: a second level, its layers checkpointed again while its backward runs,
    :func:`~megacp.models.checkpointing.checkpoint_block`). The model's own gradient checkpointing
    is switched off (this replaces it).

    Under autograd the first layer of a block runs the whole block and the block's other layers pass
    their input on; without autograd every layer runs as transformers wrote it.

    Returns:
        ``checkpoints`` (what the layers read at each forward).

    Raises:
        ValueError: ``layers_per_checkpoint < 1``, or offloaded layers without a stash.
    """
    if checkpoints.layers_per_checkpoint < 1:
        raise ValueError("activation_checkpointing.layers_per_checkpoint must be >= 1; "
                         f"got {checkpoints.layers_per_checkpoint}")
    if checkpoints.offloaded_layers and checkpoints.stash is None:
        raise ValueError("offloaded decoder layers need a host stash")
    layers = decoder_layers(model)
    if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
        model.gradient_checkpointing_disable()  # type: ignore[operator]  # a transformers PreTrainedModel
    originals = [layer.forward for layer in layers]
    for i, layer in enumerate(layers):
        def forward(hidden_states: Tensor, *args: Any, _i: int = i, **kwargs: Any) -> Tensor:
            if not torch.is_grad_enabled():
                return originals[_i](hidden_states, *args, **kwargs)
            per = checkpoints.layers_per_checkpoint
            if _i % per:  # inside a block, whose first layer ran it
                return hidden_states
            runs = [_bind(f, args, kwargs, layers[j]) for j, f in enumerate(originals[_i:_i + per], _i)]
            stash = checkpoints.stash if _i in checkpoints.offloaded_layers else None
            return checkpoint_layer(runs[0] if len(runs) == 1 else checkpoint_block(runs), hidden_states, stash)

        layer.forward = forward
    if checkpoints.stash is not None:
        stash = checkpoints.stash

        def begin(*_: Any) -> None:
            if torch.is_grad_enabled():
                stash.begin()

        model.get_decoder().register_forward_pre_hook(begin)  # type: ignore[operator]
    return checkpoints


def _bind(layer: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any],
          module: nn.Module) -> Callable[[Tensor], Tensor]:
    """``x -> layer(x, *args, **kwargs)``; a layer trained over query tiles (:func:`tile_attention`) as a
    run that keeps its input itself."""
    tiled = getattr(module, "megacp_tiled", None)
    plan = tiled(args, kwargs) if tiled is not None else None
    if plan is not None:
        return SelfCheckpointed(lambda x, stash: tiled_layer(plan, x, stash))
    return lambda x: layer(x, *args, **kwargs)


def _head(model: nn.Module) -> tuple[Tensor, float] | None:
    """``(weight [V, H], scale)`` with ``logits = scale * hidden @ weight.T``, or ``None`` when the
    output embedding is not a plain matrix megacp knows how to scale."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Linear) or head.bias is not None or getattr(config, "final_logit_softcapping", None):
        return None
    scale = 1.0
    if getattr(config, "logits_scaling", None):  # Granite divides the logits
        scale /= float(config.logits_scaling)
    if getattr(config, "logit_scale", None):  # Cohere multiplies them
        scale *= float(config.logit_scale)
    return head.weight, scale


def tiled_loss(model: nn.Module, shard: TrainShard, *, settings: Any = None,
               chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """This CP rank's share of the batch's mean token loss from a transformers causal LM, its LM
    head applied ``chunk_tokens`` rows at a time (fp32 logits of one chunk live at once).

    Raises:
        ValueError: the model's head is not a plain matrix (:func:`check_tiled_loss` says which
            models take :func:`~megacp.integrations.transformers.shard_loss` instead).
    """
    from megacp.integrations.transformers import model_inputs

    return tiled_loss_of_inputs(model, model_inputs(shard, settings), chunk_tokens=chunk_tokens)


def tiled_loss_of_inputs(model: nn.Module, inputs: dict[str, Any], *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """:func:`tiled_loss` of a batch as :func:`~megacp.integrations.transformers.prepare_batch`
    returns it (``inputs`` is not changed): the base model's final hidden states, then
    :func:`head_loss`."""
    head = _head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__}'s LM head is not a plain matrix: train it with its own loss")
    hidden = model.get_decoder()(**forward_inputs(inputs, head[0].device)).last_hidden_state  # type: ignore[operator]
    return head_loss(model, hidden, inputs, chunk_tokens=chunk_tokens)


def forward_inputs(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A prepared batch's keyword arguments of the model's forward without its labels (on ``device``)."""
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()
            if k not in ("labels", "shift_labels", "num_items_in_batch")}


def head_loss(model: nn.Module, hidden: Tensor, inputs: dict[str, Any], *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """The LM head and cross-entropy of the final hidden states ``hidden [1, n, H]`` of a prepared
    batch, ``chunk_tokens`` rows at a time, over its ``shift_labels``, divided by its
    ``num_items_in_batch`` (this rank's share of the batch's mean token loss)."""
    head = _head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__}'s LM head is not a plain matrix: train it with its own loss")
    weight, scale = head
    hidden = hidden[0] * scale if scale != 1.0 else hidden[0]
    labels = inputs["shift_labels"][0].to(weight.device)
    return chunked_cross_entropy(hidden, weight, labels, chunk_tokens) / inputs["num_items_in_batch"]


def check_tiled_loss(model: nn.Module, vocab_size: int) -> bool:
    """Whether :func:`tiled_loss` gives the model's own loss on a short random sequence (CP = 1, no
    gradients; 1e-3 relative, the bf16 rounding of a one-chunk head): ``False`` for a head that is
    not a plain matrix or that the model's forward transforms in a way megacp does not know. A model
    built partitioned by ZeRO 3 is gathered whole for the probe (its full weights once on the device)."""
    from megacp.integrations.transformers import shard_loss
    from megacp.placement.batch import shard_batch

    if _head(model) is None:
        return False
    g = torch.Generator().manual_seed(0)
    shard = shard_batch(torch.randint(0, vocab_size, (8,), generator=g), None, cu_seqlens=[0, 8], cp_size=1, cp_rank=0)
    was_training = model.training
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    gathered = contextlib.nullcontext()
    if params:  # built partitioned by ZeRO 3 (outside an engine nothing gathers them): whole, for the probe
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    try:
        model.eval()
        with torch.no_grad(), gathered:
            own, tiled = float(shard_loss(model, shard)), float(tiled_loss(model, shard))
    finally:
        model.train(was_training)
    return abs(own - tiled) <= 1e-3 * max(abs(own), 1.0)


def training_loss(model: nn.Module) -> Callable[..., Tensor]:
    """The loss :class:`megacp.train.engine.Trainer` trains a transformers model with: :func:`tiled_loss`
    where :func:`check_tiled_loss` finds it equal to the model's own, else the model's own
    (:func:`~megacp.integrations.transformers.shard_loss`, whose head forms the shard's whole logits)."""
    from megacp.integrations.transformers import shard_loss

    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    return tiled_loss if vocab and check_tiled_loss(model, vocab) else shard_loss


def _eps_name(module: nn.Module) -> str | None:
    """The attribute holding a norm module's epsilon (transformers names it either way)."""
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(module, name, None), float):
            return name
    return None


def _computes_rms_norm(module: nn.Module, width: int, dtype: torch.dtype, eps_name: str) -> bool:
    """Whether ``module``'s class forward equals :func:`~megacp.models.ops.rms_norm` bitwise on a
    random ``[3, 5, width]`` input of ``dtype`` (run on a copy holding a random weight, so a
    partitioned one is never read)."""
    g = torch.Generator().manual_seed(0)
    probe = copy.copy(module)
    weight = nn.Parameter(torch.randn(width, generator=g).to(dtype), requires_grad=False)
    probe._parameters = {"weight": weight}
    x = (3 * torch.randn(3, 5, width, generator=g)).to(dtype)
    try:
        with torch.no_grad():
            own = type(module).forward(probe, x)
            fused = rms_norm(x, weight, getattr(module, eps_name))
    except Exception:  # a forward of another signature: not this formula
        return False
    return isinstance(own, Tensor) and own.dtype == fused.dtype and torch.equal(own, fused)


def fuse_norms(model: nn.Module) -> int:
    """Run every RMSNorm module of ``model`` whose forward computes Llama's formula (statistics in
    fp32, the normalised input cast back to its dtype, then times ``weight``) as
    :func:`~megacp.models.ops.rms_norm`, bitwise equal: one fused kernel on CUDA, whose backward
    keeps the input and the fp32 inverse RMS where the formula's autograd keeps an fp32 copy of the
    ``[T, H]`` input and the cast result (and its forward makes three fp32 ``[T, H]`` transients).
    Each module class is checked once on a random input in its weight's dtype
    (:func:`_computes_rms_norm`); a norm computing anything else (Gemma's ``1 + weight``, a bias, no
    weight) keeps its own forward.

    Returns:
        The number of modules that now run the fused form.
    """
    verdicts: dict[type, bool] = {}
    fused = 0
    for module in model.modules():
        weight = module._parameters.get("weight")
        eps_name = _eps_name(module)
        if module._modules or weight is None or eps_name is None or len(module._parameters) != 1:
            continue
        shape = tuple(getattr(weight, "ds_shape", weight.shape))  # ZeRO 3 partitions hold the full shape here
        if len(shape) != 1:
            continue
        if type(module) not in verdicts:
            verdicts[type(module)] = _computes_rms_norm(module, shape[0], weight.dtype, eps_name)
        if verdicts[type(module)]:
            def forward(x: Tensor, _norm: nn.Module = module, _eps: str = eps_name) -> Tensor:
                return rms_norm(x, _norm._parameters["weight"], getattr(_norm, _eps))  # type: ignore[arg-type]

            module.forward = forward  # called through the module (its hooks fire)
            fused += 1
    return fused


def plan_config(config: Any) -> ModelConfig | None:
    """The sizes megacp's memory plan (:mod:`megacp.train.memory`) reads for a transformers model of
    ``config`` (its ``PretrainedConfig``, or ``config.json`` as a dict): the config as megacp's own
    models read it (:func:`~megacp.checkpoint.hf.config_from_hf`), else, for another dense
    architecture, a Llama-shaped :class:`~megacp.models.config.ModelConfig` of its widths, heads,
    layers and vocabulary. ``None`` for a mixture of experts megacp's models do not implement, or a
    config without those sizes."""
    from megacp.checkpoint.hf import CheckpointError, config_from_hf

    raw = config if isinstance(config, dict) else config.to_dict()
    try:
        return config_from_hf(raw)
    except CheckpointError:
        pass
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if num_experts(raw) or not all(isinstance(raw.get(k), int) for k in sizes):
        return None
    heads = raw["num_attention_heads"]
    return ModelConfig(vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                       intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
                       num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
                       head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
                       max_position_embeddings=raw.get("max_position_embeddings") or 4096,
                       tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))


@dataclass
class HFMemory:
    """The memory features :func:`apply_memory` installed on a transformers model; a memory plan
    (:class:`~megacp.train.memory.MemoryPlan`) sets them for each step's length (:meth:`apply`).

    Attributes:
        tiling: the MLPs' tiling (``None``: untiled).
        checkpoints: the decoder layers' checkpointing (``None``: not checkpointed).
        attention: the decoder layers' query tiling (``None``: untiled).
    """

    tiling: Tiling | None
    checkpoints: LayerCheckpoints | None
    attention: AttentionTiling | None = None

    def apply(self, plan: Any) -> None:
        """Set the MLP and attention tiles, the checkpoint blocks and the offloaded blocks ``plan`` (a
        :class:`~megacp.train.memory.MemoryPlan`) chose."""
        if self.tiling is not None:
            self.tiling.tile = plan.mlp_tile
        if self.attention is not None:
            self.attention.tile = plan.attention_tile
        if self.checkpoints is not None:
            self.checkpoints.layers_per_checkpoint = plan.layers_per_checkpoint
            self.checkpoints.offloaded_layers = plan.offloaded_layers


def apply_memory(model: nn.Module, memory: MemoryOptions, device: torch.device, *, unplanned: str | None) -> HFMemory:
    """Apply the memory options (:func:`megacp.config.read_memory_options`) to a transformers model:
    its RMSNorms fused (:func:`fuse_norms`), every decoder layer checkpointed (its input on the host
    with ``offload: "cpu"``; in blocks of ``layers_per_checkpoint``) and the MLPs sequence-tiled.
    ``"auto"`` values start as every block offloaded, one layer per block and the MLPs untiled, until
    the memory plan sets them before the first step (``unplanned``: ``None`` when a plan will, else why
    none will).

    Raises:
        ConfigError: ``"auto"`` without a plan, or a model these features cannot apply to.
    """
    tileable = not num_experts(getattr(model, "config", None)) and any(map(pre_norm_layer, decoder_layers(model)))
    settings: list[tuple[str, object]] = [("sequence_tiling.mlp", memory.mlp_tile)]
    if tileable:
        settings.append(("sequence_tiling.attention", memory.attention_tile))
    if memory.activation_checkpointing:
        settings[:0] = [("activation_checkpointing.offload", memory.offload),
                        ("activation_checkpointing.layers_per_checkpoint", memory.layers_per_checkpoint)]
    automatic = [key for key, value in settings if value == "auto"]
    if automatic and unplanned is not None:
        raise ConfigError(f'{automatic[0]}: "auto" is chosen by megacp\'s memory plan, and {unplanned}; give it a '
                          'value (offload "cpu" or "none", layers_per_checkpoint and sequence_tiling.mlp numbers)')
    fuse_norms(model)
    tiling = checkpoints = attention = None
    try:
        if memory.attention_tile != 0 and tileable:  # before checkpoint_layers, which hands tiled layers its stash
            attention = tile_attention(model, 0 if memory.attention_tile == "auto" else memory.attention_tile)
        if memory.activation_checkpointing:
            per = memory.layers_per_checkpoint if isinstance(memory.layers_per_checkpoint, int) else 1
            offload = memory.offload in ("cpu", "auto")
            checkpoints = checkpoint_layers(model, LayerCheckpoints(
                per, frozenset(range(0, len(decoder_layers(model)), per)) if offload else frozenset(),
                HostStash(device) if offload else None))
        if memory.mlp_tile == "auto" and not num_experts(getattr(model, "config", None)):
            tiling = tile_mlps(model, 0)  # the plan sets the tile
        elif isinstance(memory.mlp_tile, int) and memory.mlp_tile > 0:
            tiling = tile_mlps(model, memory.mlp_tile)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return HFMemory(tiling, checkpoints, attention)
