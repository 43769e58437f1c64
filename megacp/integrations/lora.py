"""LoRA adapters, as PEFT defines them, on a transformers causal LM trained under megacp's CP.

PEFT (``pip install peft``, in megacp's ``hf`` extra) puts its adapter layers into the model's own
linear modules and freezes every base weight, so megacp's CP attention, batches, memory features
and DeepSpeed engine train the same model object as without adapters; only the adapter weights
have gradients and optimizer states. :func:`add_adapters` wraps a model (``python -m megacp.train
--lora-r R``), :func:`save_adapter` writes PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``, loaded by ``peft.PeftModel.from_pretrained`` on the base model, or
``AutoPeftModelForCausalLM.from_pretrained`` from the directory alone). :class:`~megacp.integrations.
hf_trainer.CPTrainer` takes a model the user wrapped with ``peft.get_peft_model`` as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ALL_LINEAR = "all-linear"
"""PEFT's ``target_modules`` shorthand for every linear layer but the output head."""


@dataclass(frozen=True)
class LoraSettings:
    """The adapters of a run, in PEFT's ``LoraConfig`` terms.

    Attributes:
        r: the adapters' rank (``r``).
        alpha: ``lora_alpha``; an adapter's output is scaled by ``alpha / r``.
        dropout: ``lora_dropout``, on each adapter's input while training.
        target_modules: the modules that get adapters: names or name suffixes of linear modules
            (``q_proj``, ``mlp.down_proj``), or ``("all-linear",)``.
    """

    r: int
    alpha: int
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    @classmethod
    def of(cls, r: int, alpha: int | None = None, dropout: float | None = None,
           target_modules: Sequence[str] | None = None) -> LoraSettings:
        """Checked settings; ``alpha`` defaults to ``2 x r``, ``dropout`` to 0, ``target_modules``
        to ``("all-linear",)``.

        Raises:
            ValueError: one line naming the bad value (the messages name the ``--lora-*`` flags).
        """
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"--lora-r must be an integer >= 1, got {r!r}")
        alpha = 2 * r if alpha is None else alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int) or alpha < 1:
            raise ValueError(f"--lora-alpha must be an integer >= 1, got {alpha!r}")
        dropout = 0.0 if dropout is None else dropout
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"--lora-dropout must be in [0, 1), got {dropout!r}")
        targets = tuple(target_modules) if target_modules is not None else (ALL_LINEAR,)
        if not targets or any(not name.strip() for name in targets):
            raise ValueError(f"--lora-target-modules needs module names or {ALL_LINEAR}, got {list(targets)!r}")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"--lora-target-modules {ALL_LINEAR} already names every linear layer; give it alone")
        return cls(r=r, alpha=alpha, dropout=float(dropout), target_modules=targets)

    def peft_config(self) -> Any:
        """PEFT's ``LoraConfig`` of these settings (a causal LM's task)."""
        from peft import LoraConfig

        targets: str | list[str] = ALL_LINEAR if self.target_modules == (ALL_LINEAR,) else list(self.target_modules)
        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets,
                          task_type="CAUSAL_LM")

    def describe(self) -> str:
        """The settings in a progress line."""
        return (f"LoRA r {self.r}, alpha {self.alpha}, dropout {self.dropout:g} on "
                f"{', '.join(self.target_modules)}")


def peft_import_error() -> str | None:
    """Why PEFT cannot be used here (``None``: it can)."""
    try:
        import peft  # noqa: F401
    except ImportError as err:
        return f"LoRA adapters need PEFT ({err}): pip install peft"
    return None


def add_adapters(model: nn.Module, settings: LoraSettings, *, seed: int = 0) -> nn.Module:
    """``peft.get_peft_model(model, settings.peft_config())``: PEFT's adapter layers put into
    ``model``'s own modules (``model`` keeps training as the same object, its base weights frozen);
    returns the ``PeftModel`` that saves them (:func:`save_adapter`). PEFT's random start of the
    adapters is drawn with torch's generators seeded with ``seed``, so every rank (and every run)
    starts from the same adapters; the generators' states are restored afterwards.

    Raises:
        ValueError: PEFT is missing, or refuses the settings for this model (no module matches
            ``target_modules``, say), in one line.
    """
    error = peft_import_error()
    if error is not None:
        raise ValueError(error)
    from peft import get_peft_model

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return get_peft_model(model, settings.peft_config())
    except ValueError as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ValueError(f"LoRA ({settings.describe()}): {first}") from None


def save_adapter(adapted: nn.Module, directory: str, *, tokenizer: Any = None, zero_stage: int = 0) -> None:
    """Global rank 0 writes the adapters of ``adapted`` (a ``PeftModel``) in PEFT's format into
    ``directory`` (``adapted.save_pretrained``: ``adapter_config.json``, ``adapter_model.safetensors``),
    and the tokenizer's files. Under ZeRO 3 the adapter weights are gathered for it (the base stays
    partitioned). Collective when torch.distributed is initialised."""
    trainable = [p for p in adapted.parameters() if p.requires_grad]
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None):
            _write(adapted, directory, tokenizer)
    else:
        _write(adapted, directory, tokenizer)
    if dist.is_initialized():
        dist.barrier()


def _write(adapted: nn.Module, directory: str, tokenizer: Any) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    state = {name: p.detach().cpu().clone() for name, p in adapted.named_parameters() if p.requires_grad}
    adapted.save_pretrained(directory, state_dict=state)  # type: ignore[operator]  # a peft.PeftModel
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
