"""Training memory: the options that trade compute or host memory for GPU memory, and the plan that
picks them per sequence length and says, before the first step, whether a step will fit.

Options (from the DeepSpeed config, :func:`megacp.config.read_memory_options`)::

    "activation_checkpointing": {"enabled": true, "offload": "auto"},   # "none" | "cpu" | "auto"
    "sequence_tiling": {"mlp": "auto", "attention": "auto"},             # "auto" | tokens per tile | 0

* ``activation_checkpointing.enabled`` (or ``--activation-checkpointing``): each decoder layer keeps
  only its input and runs again in backward (:mod:`megacp.models.checkpointing`).
  ``offload``: those inputs wait in pinned host memory — ``"cpu"`` every layer's, ``"auto"`` as
  few layers' as the GPU needs (the earliest layers, whose inputs wait longest). DeepSpeed's own
  keys of that section (``partition_activations``, ``cpu_checkpointing``, ...) configure
  ``deepspeed.checkpointing``, which megacp's layers do not use: they are refused.
* ``sequence_tiling.mlp``: dense layers' MLPs run over sequence tiles (:mod:`megacp.models.tiling`);
  ``"auto"`` tiles (:data:`AUTO_MLP_TILE` tokens) only when the plan needs it.
* ``sequence_tiling.attention``: dense layers train over tiles of their query rows, keeping only their
  input (:mod:`megacp.models.tiled_layer`; :func:`tiled_layer_bytes_per_token` beside one tile's work);
  ``"auto"`` tiles (:data:`AUTO_ATTENTION_TILE` rows) only when the plan needs it and the model's
  layers can (``tiled_attention``).

The plan (:func:`plan_memory`) estimates one rank's peak GPU bytes as model states (by ZeRO stage and
offload, :func:`state_bytes`) + checkpointed layer inputs kept on the GPU + one layer's working set
in its backward (:func:`working_bytes_per_token`) + fixed buffers, and the host bytes of the states
and of what is offloaded (each input in whole pages, :func:`pinned_bytes`), checked against the
host's available memory less :data:`HOST_RESERVE_BYTES`. Under ``auto`` it takes the cheapest
settings that fit: untiled and nothing offloaded, else the MLP tiled, else as many layers offloaded
as needed, each first with every layer its own checkpoint, then (``layers_per_checkpoint: "auto"``)
blocks of 2, 4 and 8 layers, whose fewer inputs fit a smaller host; all of that first with the
attention untiled, then over query tiles. It is an estimate
(``docs/PERFORMANCE.md`` compares it with measured peaks); :class:`MemoryPlanError` names the
settings or sequence length that would fit.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megacp.config import ConfigError, DeepSpeedSections, MemoryOptions, load_config
from megacp.kv_cache.storage import available_bytes
from megacp.models.config import ModelConfig
from megacp.models.lm_head import DEFAULT_CHUNK_TOKENS

AUTO_MLP_TILE = 8192
"""Tokens per MLP tile when ``sequence_tiling.mlp`` is ``"auto"`` and the plan tiles."""

AUTO_ATTENTION_TILE = 16384
"""Local query rows per tile when ``sequence_tiling.attention`` is ``"auto"`` and the plan tiles."""

GPU_RESERVE_BYTES = 6 * 2**30
"""GPU bytes the plan leaves free of its estimate: CUDA context, communicator buffers, kernel
workspaces and the caching allocator's fragmentation."""

HOST_RESERVE_BYTES = 12 * 2**30
"""Host bytes the plan leaves free of its host estimate: the training process's own memory beside
the model states and the offloaded layer inputs (CUDA and torch libraries, the pinned allocator's
power-of-two rounding of DeepSpeed's buffers, CPU Adam's working memory). Fitted to the 32-layer
Llama-3.1-8B shape under ZeRO 3 with bf16 optimizer states on the host at 16K tokens on an H100:
91.1 GiB peak RSS against 78.8 GiB of states and inputs."""

class MemoryPlanError(ValueError):
    """A training step will not fit (one line: the estimate and what would fit)."""


@dataclass(frozen=True)
class ZeroSettings:
    """The parts of DeepSpeed's ``zero_optimization`` and ``bf16`` sections that place model states.

    Attributes:
        stage: ZeRO stage 0-3; partition: ranks ZeRO partitions over (DP x CP).
        offload_optimizer / offload_param: ``device: cpu`` set.
        param_bytes: bytes per parameter element (2 bf16, 4 fp32).
        bf16_optimizer_states: master weights, gradients and Adam states in bf16
            (``bf16.bf16_master_weights_and_grads`` + ``bf16_optimizer_states``).
    """

    stage: int
    partition: int
    offload_optimizer: bool
    offload_param: bool
    param_bytes: int
    bf16_optimizer_states: bool = False

    @classmethod
    def of(cls, sections: DeepSpeedSections, *, partition: int, dtype: torch.dtype) -> ZeroSettings:
        """The placement DeepSpeed's sections (read once, :class:`~megacp.config.DeepSpeedSections`) give
        a model of ``dtype`` partitioned over ``partition`` ranks."""
        return cls(stage=sections.zero_stage, partition=partition, offload_optimizer=sections.offload_optimizer,
                   offload_param=sections.offload_param, param_bytes=torch.empty((), dtype=dtype).element_size(),
                   bf16_optimizer_states=sections.bf16_optimizer_states)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], *, partition: int, dtype: torch.dtype) -> ZeroSettings:
        """:meth:`of` the sections of the DeepSpeed config ``raw`` (as :func:`~megacp.config.load_config` reads them)."""
        return cls.of(load_config(raw).deepspeed_sections, partition=partition, dtype=dtype)


def state_bytes(params: int, largest_module: int, zero: ZeroSettings) -> tuple[int, int]:
    """``(gpu, host)`` bytes of one rank's model states: parameters, gradients, the optimizer's
    master weights and Adam moments.

    Args:
        params: parameters of this rank's model (elements); largest_module: elements of the
            largest module ZeRO 3 gathers at once (the embedding or the LM head).
        zero: the ZeRO placement.

    Per parameter: weights and gradients of ``param_bytes`` each; a low-precision model's fp32
    master weights (4) and gradient partition (4); Adam's two moments (4 each), all in bf16 with
    ``bf16_optimizer_states``. Stage 1 partitions the optimizer's part, 2 the gradients too, 3 the
    weights too; offloaded parts go to the host. With the optimizer offloaded, stage 2 streams the
    reduced gradients to the host, and stage 3 also keeps its reduced-gradient partition (DeepSpeed's
    ``grad_partitions_flat_buffer``, in the model's dtype) in host memory.
    """
    e, z = zero.param_bytes, max(zero.partition, 1)
    optim = float(8 if zero.bf16_optimizer_states else 8 + (8 if e < 4 else 0))  # master, grad, moments
    weights, grads = float(e), float(e)
    if zero.stage >= 1:
        optim /= z
    if zero.stage >= 2:
        grads /= z
    if zero.stage >= 3:
        weights /= z
    gpu, host = 0.0, 0.0
    if zero.offload_optimizer:
        host += optim * params
        if zero.stage >= 3:  # the reduced-gradient partition lives on the host beside the optimizer's
            host += grads * params
        grads = 0.0 if zero.stage >= 2 else grads  # reduced gradients stream to the host
    else:
        gpu += optim * params
    if zero.stage >= 3 and zero.offload_param:
        host += weights * params
        gpu += 2 * largest_module * e  # the gathered module and the next one prefetched
    else:
        gpu += weights * params + (2 * largest_module * e if zero.stage >= 3 else 0)
    gpu += grads * params
    return int(gpu), int(host)


def working_bytes_per_token(cfg: ModelConfig, elem: int, tokens: int, *, tp: int = 1, cp: int = 1,
                            mlp_tiled: bool, norm_apart: bool = False) -> int:
    """GPU bytes per local token of one decoder layer's recompute and backward at their peak (the
    attention's backward), with the residual stream's gradients, for a step of ``tokens`` tokens.

    Attention: the normed input and its weighted copy, rotated q/k, v, the output, the residual
    (kept for the backward), the gradients autograd holds at once, dQ/dK/dV and the fused kernel's
    fp32 dQ accumulator of one call (:func:`~megacp.attention.kernels.partial_backward.head_groups`). The
    MLP untiled adds gate/up ``[2F]``, ``silu(gate)`` and the product ``[F]`` and their gradients
    (``F`` per TP rank); tiled it adds nothing per token, unless the norm before it runs apart from the
    tiles (``norm_apart``: a transformers layer, whose ``post_attention_layernorm`` keeps its
    normalised and its weighted ``[T, H]`` for the backward: two more). Under CP (``cp`` > 1) the ring adds the KV
    blocks in flight and the travelling fp32 dK/dV accumulators (sent and received), and an fp32
    dQ accumulator beyond two ranks. Fitted to a memory trace of the Llama-3.1-8B shape at 128K
    tokens on an H200 (``docs/PERFORMANCE.md``); the CP terms count the buffers, unmeasured.
    """
    from megacp.attention.kernels.partial_backward import head_groups

    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim // tp
    kv = cfg.num_kv_heads * cfg.head_dim // tp
    groups = head_groups(tokens, cfg.num_heads // tp, max(cfg.num_kv_heads // tp, 1), cfg.head_dim)
    attention = elem * (8 * h + 3 * q + 4 * kv) + 4 * q // groups
    mlp = (2 * elem * h if norm_apart else 0) if mlp_tiled else elem * 8 * cfg.intermediate_size // tp
    ring = 0 if cp == 1 else 2 * elem * 2 * kv + 2 * 4 * 2 * kv + (4 * q if cp > 2 else 0)
    return attention + mlp + ring


def tiled_layer_bytes_per_token(cfg: ModelConfig, elem: int, *, tp: int = 1, cp: int = 1) -> int:
    """GPU bytes per local token of one decoder layer's backward when it runs over query tiles
    (:mod:`megacp.models.tiled_layer`), beyond its input and beyond one tile's work: the incoming
    gradient and the input's gradient ``[T, H]``, the layer's KV block and its fp32 K/V gradient
    accumulators; under CP the KV blocks in flight and the travelling fp32 accumulators (sent and
    received). Llama-3.1-8B's shape, bf16, CP 1: 28 KiB per token."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim // tp
    ring = 0 if cp == 1 else 2 * elem * 2 * kv + 2 * 4 * 2 * kv
    return 2 * elem * h + 2 * elem * kv + 4 * 2 * kv + ring


LOSS_BYTES_PER_ROW = 18
"""GPU bytes per (chunk row x vocabulary entry) of the chunked loss's forward: the bf16 logits,
their fp32 log-softmax and its input copy, the gradient chunk (measured: 17.6 GiB for 8192 rows of
a 128,256-token vocabulary)."""


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's estimated memory for a training step of ``tokens`` local tokens, and the settings
    the model runs with.

    Attributes:
        tokens: local tokens per micro-batch (sequence length x micro-batch / CP).
        mlp_tile: tokens per MLP tile (0 untiled).
        attention_tile: local query rows per tile of the layers trained over query tiles (0 untiled).
        offloaded_layers: the first layers of the checkpoint blocks whose inputs go to the host.
        layers_per_checkpoint: layers per checkpoint block (1: every layer is one).
        gpu_bytes / host_bytes: the estimated peaks (states included).
        capacity_bytes: the GPU bytes the plan fits into (``None``: unchecked, CPU).
    """

    tokens: int
    mlp_tile: int
    offloaded_layers: frozenset[int]
    gpu_bytes: int
    host_bytes: int
    capacity_bytes: int | None
    layers_per_checkpoint: int = 1
    attention_tile: int = 0

    def describe(self) -> str:
        off, per = len(self.offloaded_layers), self.layers_per_checkpoint
        inputs = "block inputs" if per > 1 else "layer inputs"
        return (f"{self.tokens} tokens per rank: ~{self.gpu_bytes / 2**30:.1f} GiB GPU"
                + (f" of {self.capacity_bytes / 2**30:.1f}" if self.capacity_bytes else "")
                + f", ~{self.host_bytes / 2**30:.1f} GiB host; MLP "
                + (f"tiled by {self.mlp_tile}" if self.mlp_tile else "untiled")
                + (f", attention over query tiles of {self.attention_tile}" if self.attention_tile else "")
                + (f", checkpoints of {per} layers" if per > 1 else "")
                + (f", {off} {inputs} offloaded" if off else ""))

    def apply(self, model: torch.nn.Module) -> None:
        """Set the model's MLP and attention tiles, checkpoint blocks and offloaded blocks (megacp's
        :class:`~megacp.models.llama.CausalLM`)."""
        from megacp.models.llama import DecoderLayer, LayerNormMLP

        for module in model.modules():
            if isinstance(module, LayerNormMLP):
                module.tile_tokens = self.mlp_tile
            elif isinstance(module, DecoderLayer):
                module.attention_tile = self.attention_tile
        if hasattr(model, "offloaded_layers"):
            setattr(model, "offloaded_layers", self.offloaded_layers)  # noqa: B010 - a CausalLM attribute
            setattr(model, "layers_per_checkpoint", self.layers_per_checkpoint)  # noqa: B010


def pinned_bytes(nbytes: int, page: int = mmap.PAGESIZE) -> int:
    """Host bytes an offloaded input of ``nbytes`` holds: its pinned buffer is whole pages of ``page``
    bytes of its own (:func:`~megacp.models.checkpointing.page_locked_empty`), ``nbytes`` rounded up to
    a page (a 192K-token layer input of 1.5 GiB holds 1.5 GiB)."""
    return -(-nbytes // page) * page


def gpu_capacity(device: torch.device) -> int | None:
    """Usable bytes of ``device`` for one training process (``None`` on CPU): its total memory less
    :data:`GPU_RESERVE_BYTES`."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory - GPU_RESERVE_BYTES


def host_available() -> int:
    """Bytes of host memory available now (``MemAvailable``; total memory where unreadable)."""
    return available_bytes("cpu")


def plan_memory(cfg: ModelConfig, *, params: int, tokens: int, options: MemoryOptions, zero: ZeroSettings,
                capacity: int | None, host: int | None = None, tp: int = 1, cp: int = 1,
                dense_mlp: bool = True, norm_apart: bool = False, tiled_attention: bool = False) -> MemoryPlan:
    """The settings and estimated peaks of a step of ``tokens`` local tokens (:func:`_plan`); a refusal
    also names the most local tokens these settings fit.

    Raises:
        MemoryPlanError: the step does not fit even with the configured options at their most frugal.
    """
    shape = dict(params=params, options=options, zero=zero, capacity=capacity, host=host, tp=tp, cp=cp,
                 dense_mlp=dense_mlp, norm_apart=norm_apart, tiled_attention=tiled_attention)
    try:
        return _plan(cfg, tokens=tokens, **shape)  # type: ignore[arg-type]
    except MemoryPlanError as err:
        lo, hi = 0, tokens  # lo tokens fit (or lo == 0), hi do not
        while hi - lo > max(1, hi // 256):
            mid = (lo + hi) // 2
            try:
                _plan(cfg, tokens=mid, **shape)  # type: ignore[arg-type]
                lo = mid
            except MemoryPlanError:
                hi = mid
        most = f"at most ~{lo} tokens per rank fit these settings" if lo else "no step fits these settings"
        raise MemoryPlanError(f"{err}; {most}") from None


def _plan(cfg: ModelConfig, *, params: int, tokens: int, options: MemoryOptions, zero: ZeroSettings,
          capacity: int | None, host: int | None, tp: int, cp: int, dense_mlp: bool, norm_apart: bool,
          tiled_attention: bool) -> MemoryPlan:
    """The settings and estimated peaks of a step of ``tokens`` local tokens.

    Args:
        cfg: the model; params: its parameters on this rank (elements).
        options: the configured memory options (``"auto"`` parts resolved here).
        zero: where the model states live; capacity: usable GPU bytes (``None``: do not check);
        host: host bytes available (``None``: do not check).
        tp / cp: tensor- and context-parallel sizes; dense_mlp: the model's MLPs can be tiled
            (megacp's torch layers, a transformers model without experts); norm_apart: the MLP's
            norm runs outside its tiles (a transformers model, :func:`working_bytes_per_token`);
            tiled_attention: every layer can train over query tiles (:mod:`megacp.models.tiled_layer`):
            ``sequence_tiling.attention`` may then tile them.

    Raises:
        MemoryPlanError: the step does not fit even with the configured options at their most frugal.
    """
    elem = zero.param_bytes
    largest = cfg.vocab_size * cfg.hidden_size
    gpu_states, host_states = state_bytes(params, largest, zero)
    layer_input = elem * cfg.hidden_size * tokens
    pinned_input = pinned_bytes(layer_input)
    layers = cfg.num_layers
    loss = min(tokens, DEFAULT_CHUNK_TOKENS) * cfg.vocab_size * LOSS_BYTES_PER_ROW + 2 * layer_input

    def estimate(tile: int, offloaded: int, per: int, rows: int = 0) -> tuple[int, int]:
        """(GPU, host) peaks: the states plus the larger of the loss's forward and a layer's backward
        (``offloaded`` of the ``ceil(layers / per)`` checkpoint blocks' inputs on the host; a block
        of ``per > 1`` layers holds its layers' inputs while its backward runs; ``rows``: the layers
        run over query tiles of that many rows, each keeping its input)."""
        blocks = -(-layers // per)
        checkpointed = options.activation_checkpointing or rows > 0
        kept = (blocks - offloaded) if options.activation_checkpointing else layers if rows else 0
        if rows:  # one tile's untiled work (its MLP tiled within when mlp_tile is shorter) + the whole-layer part
            within = working_bytes_per_token(cfg, elem, rows, tp=tp, cp=1, mlp_tiled=0 < tile < rows)
            work = tiled_layer_bytes_per_token(cfg, elem, tp=tp, cp=cp) * tokens + within * rows
        else:
            work = working_bytes_per_token(cfg, elem, tokens, tp=tp, cp=cp, mlp_tiled=tile > 0,
                                           norm_apart=norm_apart) * tokens
        if not checkpointed:  # every layer's activations stay for the backward
            work *= layers
        tile_work = elem * tile * 10 * cfg.intermediate_size // tp if tile else 0
        prefetch = 2 * layer_input if offloaded else 0  # a block's input and the next one, fetched back
        inner = per * layer_input if per > 1 else 0  # the recomputed block's layer inputs
        backward = kept * layer_input + inner + work + tile_work + prefetch
        return gpu_states + max(kept * layer_input + loss, backward), host_states + offloaded * pinned_input

    tiles, rows_options = _tile_choices(options, tokens, dense_mlp=dense_mlp, tiled_attention=tiled_attention)
    pers = [options.layers_per_checkpoint] if options.layers_per_checkpoint != "auto" else [1, 2, 4, 8]
    pers = [p for p in pers if p == 1 or p <= layers] or [1]

    def offloads(per: int) -> list[int]:
        blocks = -(-layers // per)
        if not options.activation_checkpointing:
            return [0]
        return {"none": [0], "cpu": [blocks], "auto": list(range(blocks + 1))}[options.offload]

    # cheapest first: untiled, every layer its own checkpoint (no third forward), fewest offloaded
    candidates = [(t, p, o, r) for r in rows_options for t in tiles for p in pers for o in offloads(p)]
    best = None
    for tile, per, offloaded, rows in candidates:
        gpu, host_need = estimate(tile, offloaded, per, rows)
        if best is None or gpu < best[3]:
            best = (tile, per, offloaded, gpu, host_need, rows)
        if (capacity is None or gpu <= capacity) and (host is None or host_need + HOST_RESERVE_BYTES <= host):
            return MemoryPlan(tokens, tile, frozenset(range(0, offloaded * per, per)), gpu, host_need, capacity, per,
                              rows)
    assert best is not None
    tile, per, offloaded, gpu, host_need, rows = best
    plan = MemoryPlan(tokens, tile, frozenset(range(0, offloaded * per, per)), gpu, host_need, capacity, per, rows)
    if capacity is not None and gpu > capacity:
        raise MemoryPlanError(f"a training step will not fit: {plan.describe()}; "
                              + _suggestion(cfg, options, zero, tokens, gpu - capacity))
    hint = ('; try "activation_checkpointing": {"layers_per_checkpoint": "auto"} (fewer inputs on the host)'
            if options.layers_per_checkpoint == 1 and options.activation_checkpointing else "")
    raise MemoryPlanError(f"a training step will not fit in host memory: {plan.describe()} "
                          f"(available {host / 2**30:.1f} GiB, {HOST_RESERVE_BYTES / 2**30:.0f} GiB of it kept for "
                          f"the process){hint}" if host is not None else plan.describe())


def _tile_choices(options: MemoryOptions, tokens: int, *, dense_mlp: bool,
                  tiled_attention: bool) -> tuple[list[int], list[int]]:
    """The MLP tiles and the attention's query-tile rows the plan tries for a step of ``tokens`` local
    tokens (0: untiled; ``"auto"``: untiled, then the default tile), cheapest first.

    Raises:
        ConfigError: a tile set for a model whose layers cannot take it.
    """
    tiles = [options.mlp_tile] if options.mlp_tile != "auto" else [0, AUTO_MLP_TILE]
    tiles = [t for t in tiles if t == 0 or t < tokens] or [0]
    if not dense_mlp and any(tiles):
        if options.mlp_tile != "auto":
            raise ConfigError("sequence_tiling.mlp: tiles dense MLPs only (this model has MoE or "
                              "Transformer Engine layers); set it to 0 or \"auto\"")
        tiles = [0]
    rows = [options.attention_tile] if options.attention_tile != "auto" else [0, AUTO_ATTENTION_TILE]
    rows = [r for r in rows if r == 0 or r < tokens] or [0]
    if not tiled_attention and any(rows):
        if options.attention_tile != "auto":
            raise ConfigError("sequence_tiling.attention: tiles dense decoder layers of megacp's models and "
                              "transformers layers of Llama's pre-norm formula only (this model has others); set it "
                              'to 0 or "auto"')
        rows = [0]
    return tiles, rows


def _suggestion(cfg: ModelConfig, options: MemoryOptions, zero: ZeroSettings, tokens: int, excess: int) -> str:
    hints = []
    if not options.activation_checkpointing:
        hints.append('"activation_checkpointing": {"enabled": true, "offload": "auto"}')
    elif options.offload == "none":
        hints.append('"activation_checkpointing": {"offload": "auto"}')
    if options.mlp_tile == 0:
        hints.append('"sequence_tiling": {"mlp": "auto"}')
    if options.attention_tile == 0:
        hints.append('"sequence_tiling": {"attention": "auto"}')
    if zero.stage < 3 or not zero.offload_optimizer:
        hints.append("ZeRO 3 with offload_optimizer / offload_param to cpu")
    hints.append("a shorter --seq-len or a larger context_parallel.size")
    return "try " + "; ".join(hints)


def longest_fitting(cfg: ModelConfig, *, params: int, options: MemoryOptions, zero: ZeroSettings,
                    capacity: int | None, host: int | None, multiple: int, cp: int = 1, batch: int = 1, tp: int = 1,
                    dense_mlp: bool = True, norm_apart: bool = False, tiled_attention: bool = False,
                    limit: int | None = None) -> int:
    """The longest sequence length (a multiple of ``multiple``, at most ``limit``) whose step of
    ``batch`` sequences (``length x batch / cp`` local tokens) fits (``--seq-len auto``); 0 when none does."""
    def fits(length: int) -> bool:
        try:
            _plan(cfg, params=params, tokens=-(-length * batch // cp), options=options, zero=zero, capacity=capacity,
                  host=host, tp=tp, cp=cp, dense_mlp=dense_mlp, norm_apart=norm_apart, tiled_attention=tiled_attention)
            return True
        except MemoryPlanError:
            return False

    lo, hi = 0, (limit or 1 << 26) // multiple
    if fits(hi * multiple):
        return hi * multiple
    while hi - lo > 1:  # lengths lo * multiple fit (or lo == 0), hi * multiple do not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * multiple) else (lo, mid)
    return lo * multiple


def count_parameters(model: torch.nn.Module) -> int:
    """Parameter elements of ``model`` on this rank (ZeRO 3's partitioned parameters counted whole)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
