"""Hugging Face ``Trainer`` under megacp's context parallelism: :class:`CPTrainer`.

An existing Trainer script changes in three lines::

    state = megacp.initialize(config)                                   # the CP x DP mesh
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="megacp")
    trainer = CPTrainer(model=model, args=args, train_dataset=ds, cp_state=state)   # was Trainer(...)

and runs under ``torchrun`` / ``deepspeed`` as before. Every CP rank of a group iterates the same
batches (a sampler over the DP ranks only); each batch (``input_ids`` with ``labels``, and
``attention_mask`` or ``position_ids`` as transformers' collators produce them) becomes this
rank's load-balanced share (:func:`~megacp.integrations.transformers.prepare_batch`: ``input_ids``,
``position_ids``, pre-shifted ``shift_labels``); the loss is each rank's share of the token mean
over the valid labels of every sequence of the optimizer step (all gradient-accumulation batches,
all CP and DP ranks: transformers' ``num_items_in_batch``), and is multiplied by the world size so
that the data-parallel mean of gradients (DDP's or DeepSpeed's, over every rank) is their sum over
the CP ranks, averaged over DP.

The CP part is :class:`CPTrainerMixin`, which goes before any ``Trainer`` subclass — TRL's
``SFTTrainer`` for one — so that its batches, loss and data loader are megacp's::

    class CPSFTTrainer(CPTrainerMixin, SFTTrainer): ...     # or: cp_trainer(SFTTrainer)
    trainer = CPSFTTrainer(model=model, args=sft_config, train_dataset=ds, cp_state=state)

``CPTrainer`` is the mixin over ``Trainer`` itself. The subclass's collator makes the batches (packed documents
as ``position_ids`` resets, as TRL's packing makes them; labels ``-100`` outside the completion); its own
``compute_loss`` and metrics are replaced by megacp's sharded loss.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from transformers import Trainer

from megacp.config import MemoryOptions, read_memory_options
from megacp.integrations.hf_memory import Tiling, apply_memory, check_tiled_loss, forward_inputs, head_loss
from megacp.integrations.transformers import (
    STEP_KWARG,
    check_mesh,
    check_model,
    prepare_batch,
    verify_attention_calls,
    without_adapters,
)

BATCH_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})
"""What a batch of :class:`CPTrainer` may hold (a collator's output)."""


class _EpochLoader(DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` (what the Trainer calls each epoch) reshuffles its
    :class:`~torch.utils.data.DistributedSampler`."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]  # always the DistributedSampler below


if TYPE_CHECKING:  # the mixin's view of the Trainer it is combined with
    from transformers import Trainer as _TrainerBase
else:
    _TrainerBase = object


class CPTrainerMixin(_TrainerBase):
    """The CP behaviour of a ``transformers.Trainer`` (sub)class: listed before it in the bases
    (``class T(CPTrainerMixin, SFTTrainer)``, :func:`cp_trainer`), it shards the batches over
    megacp's CP group and replaces the loss with each rank's share of the step's token mean.

    Args:
        cp_state: the :class:`megacp.ParallelState` (CP and DP groups; TP and PP must be 1).
        memory: the long-sequence memory settings of ``python -m megacp.train``, as the
            ``activation_checkpointing`` and ``sequence_tiling`` sections of a DeepSpeed config dict
            (other keys are ignored, so the run's whole config may be passed;
            :func:`megacp.config.read_memory_options`): every decoder layer checkpointed by megacp
            (``"offload": "cpu"``: its input in pinned host memory; ``layers_per_checkpoint``: a
            second checkpoint level), MLPs over sequence tiles, and the LM head + loss over chunks
            of 8192 tokens (never the shard's ``S x vocab`` logits) where that equals the model's
            own loss (:func:`~megacp.integrations.hf_memory.check_tiled_loss`). ``None``: the
            model as it is.
            ``sequence_tiling.attention`` (query tiles) applies only where given: no memory plan
            chooses it here.
        args, kwargs: as the trainer class's. The model (or the transformers model inside a PEFT
            ``PeftModel``) must use ``attn_implementation="megacp"``.

    Raises:
        ValueError: TP or PP > 1, ``average_tokens_across_devices=False``, a model without megacp's
            attention, or one whose layers do not all reach it (one line, before training:
            :func:`~megacp.integrations.transformers.verify_attention_calls`); ``memory`` with
            transformers' own ``gradient_checkpointing`` too, or a bad memory setting
            (:class:`~megacp.config.ConfigError`).
    """

    loss_is_scaled_for_ga = True  # normalised over the whole accumulated batch (get_batch_samples)

    def __init__(self, *args: Any, cp_state: Any, memory: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        name = type(self).__name__
        check_mesh(cp_state)
        options = read_memory_options(memory) if memory is not None else None
        if options is not None and memory is not None and "attention" not in (memory.get("sequence_tiling") or {}):
            options = dataclasses.replace(options, attention_tile=0)  # no memory plan chooses query tiles here
        if (options is not None and isinstance(options.attention_tile, int) and options.attention_tile > 0
                and dist.is_initialized() and dist.get_world_size() > 1):
            raise ValueError(f"{name} memory=: sequence_tiling.attention trains the layers over query tiles, whose "
                             "per-tile gradients DDP cannot take (it marks a parameter ready once a step); train "
                             "such layers with megacp.train (DeepSpeed), or leave sequence_tiling.attention unset")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if options is not None and options.activation_checkpointing and training_args is not None:
            # a layer recomputed in the backward marks its parameters ready there: DDP must not mark
            # the ones the (no-grad) forward did not use as unused before
            if training_args.ddp_find_unused_parameters:
                raise ValueError(f"{name} memory= checkpoints the decoder layers: TrainingArguments."
                                 "ddp_find_unused_parameters=True cannot be used with it (leave it unset)")
            training_args.ddp_find_unused_parameters = False
        super().__init__(*args, **kwargs)
        if not self.args.average_tokens_across_devices:
            raise ValueError(f"{name} divides the loss by the valid labels of every rank's sequences: "
                             "average_tokens_across_devices=False is not supported")
        impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if impl != "megacp":
            raise ValueError(f"{name} needs the model loaded with attn_implementation=\"megacp\", it has {impl!r}")
        check_model(self.model)
        verify_attention_calls(self.model)
        self.cp_state = cp_state
        self._tiling: Tiling | None = None
        self._hidden: list[torch.Tensor] | None = None
        """With the tiled loss: the base model's final hidden states of the forward in flight."""
        if options is not None:
            self._apply_memory(options)

    def _apply_memory(self, options: MemoryOptions) -> None:
        if options.activation_checkpointing and self.args.gradient_checkpointing:
            raise ValueError(f"{type(self).__name__} memory= checkpoints the decoder layers itself: leave TrainingArguments."
                             "gradient_checkpointing off")
        model: Any = without_adapters(self.model)  # a PEFT model's adapters live in the model's own modules
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        tiled = bool(vocab) and "logits_to_keep" in inspect.signature(model.forward).parameters and \
            check_tiled_loss(model, vocab)
        self._tiling = apply_memory(model, options, self.cp_state.device,
                                    unplanned=f"{type(self).__name__} has none (Hugging Face's Trainer runs the steps)").tiling
        if tiled:  # the forward keeps one token's logits; the loss takes the decoder's output
            self._hidden = []
            model.get_decoder().register_forward_hook(
                lambda _module, _args, out: self._hidden.append(out.last_hidden_state))

    def get_train_dataloader(self) -> DataLoader:
        """The training batches of this rank's DP group (the same on every CP rank of it), shuffled
        per epoch with ``args.seed``; not sharded further by accelerate."""
        dataset: Any = self.train_dataset
        if dataset is None:
            raise ValueError(f"{type(self).__name__} needs a train_dataset")
        collator = self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=self.cp_state.size("dp"), rank=self.cp_state.rank_in("dp"),
                                     shuffle=True, seed=self.args.seed, drop_last=self.args.dataloader_drop_last)
        return _EpochLoader(dataset, batch_size=self._train_batch_size, sampler=sampler, collate_fn=collator,
                          drop_last=self.args.dataloader_drop_last, num_workers=self.args.dataloader_num_workers)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, torch.Tensor | int | None]:
        """The next ``num_batches`` batches as this rank's shares, and the valid labels of all of
        them on every rank (``num_items_in_batch``, an int; one all-reduce)."""
        shards = []
        for _ in range(num_batches):
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                break
            unknown = sorted(set(batch) - BATCH_KEYS)
            if unknown:
                raise ValueError(f"{type(self).__name__} batches hold {', '.join(sorted(BATCH_KEYS))}; this one also has {', '.join(unknown)}")
            shards.append(prepare_batch(batch["input_ids"], labels=batch.get("labels"),
                                        position_ids=batch.get("position_ids"),
                                        attention_mask=batch.get("attention_mask"), state=self.cp_state))
        if not shards:
            return shards, None
        valid = torch.stack([s["shift_labels"].ne(-100).sum() for s in shards]).sum().to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(valid)  # every CP rank's share of every DP rank's sequences
        total = max(int(valid), 1)
        for s in shards:
            s["num_items_in_batch"] = total
        return shards, total

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """This rank's share of the step's token mean (``inputs`` from :meth:`get_batch_samples`),
        times the world size (the data-parallel gradient mean then sums the CP ranks' shares)."""
        if STEP_KWARG not in inputs:
            raise ValueError(f"{type(self).__name__} shards its training batches only; evaluate with a plain Trainer")
        if self._tiling is not None:  # every rank cuts as many MLP tiles (ZeRO 3 gathers per call)
            self._tiling.step_tokens = int(inputs["input_ids"].shape[-1])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self._hidden is not None:  # the tiled LM head + loss (memory=): through the (wrapped) model's forward
            self._hidden.clear()
            outputs = model(**forward_inputs(inputs, inputs["input_ids"].device), logits_to_keep=1)
            loss = head_loss(without_adapters(self.model), self._hidden.pop(), inputs) * world
        else:
            outputs = model(**inputs)
            loss = outputs.loss * world
        return (loss, outputs) if return_outputs else loss


def cp_trainer(trainer_class: type[Trainer]) -> type[Trainer]:
    """``trainer_class`` (``transformers.Trainer`` or a subclass of it, e.g. TRL's ``SFTTrainer``)
    with :class:`CPTrainerMixin` before it: a class named ``CP<name>`` whose constructor also takes
    ``cp_state`` and ``memory``.

    Raises:
        TypeError: ``trainer_class`` is not a ``transformers.Trainer`` class.
    """
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"cp_trainer takes a transformers.Trainer class, got {trainer_class!r}")
    if issubclass(trainer_class, CPTrainerMixin):
        return trainer_class
    return type(f"CP{trainer_class.__name__}", (CPTrainerMixin, trainer_class),
                {"__module__": trainer_class.__module__, "__doc__": trainer_class.__doc__})


class CPTrainer(CPTrainerMixin, Trainer):
    """``transformers.Trainer`` whose batches are sharded over megacp's CP group
    (:class:`CPTrainerMixin` over ``Trainer``)."""
