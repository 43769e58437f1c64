"""``python -m megacp.train --lora-r``: PEFT's LoRA adapters (r 8 on every linear layer) on a tiny
Llama directory, trained through transformers' modules, give the same losses and adapters at CP 1
(ZeRO 1) and CP 2 (ZeRO 1 with every layer input on the host and tiled MLPs; ZeRO 3) (fp32, real
gloo ranks; losses 1e-5 relative, all adapter weights 1e-5 relative in norm and 1e-4 in the worst
element); the base weights do not change, the optimizer holds the adapters' states only, and
the adapters written in PEFT's format reload with ``peft.PeftModel.from_pretrained`` to the logits of
the trained model. Bad ``--lora-*`` values, target modules that match nothing and a model that is not
a Hugging Face directory are refused in one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.reference import rel_err
from tests.helpers.timeouts import HANG_GUARD_S
from tests.helpers.train_cli import make_corpus, make_tiny_model
from tests.helpers.training import ELEMENT_RTOL, RTOL

pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
pytest.importorskip("peft", reason="LoRA adapters are PEFT's: pip install peft")

SEQ_LEN = 40
STEPS = 3
LORA = ["--lora-r", "8", "--lora-alpha", "16"]


def _write_configs(tmp: Path) -> None:
    """``configs/train_cpu_cp2.json`` with a constant learning rate of 1e-2, as CP 1 (``cp1.json``),
    CP 2 with the layer inputs on the host and MLP tiles of 8 tokens (``cp2.json``) and CP 2 under
    ZeRO 3 (``cp2_zero3.json``)."""
    config = json.loads((ROOT / "configs" / "train_cpu_cp2.json").read_text())
    config.pop("scheduler")
    config["optimizer"]["params"]["lr"] = 1e-2
    memory = {"activation_checkpointing": {"enabled": True, "offload": "cpu"}, "sequence_tiling": {"mlp": 8}}
    for name, extra in (("cp1", {"context_parallel": {"size": 1}}), ("cp2", memory),
                        ("cp2_zero3", {"zero_optimization": {"stage": 3}})):
        (tmp / f"{name}.json").write_text(json.dumps({**config, **extra}))


def _main(tmp: Path, port: int, name: str, *extra: str) -> int:
    """``megacp.train``'s main in this rank with the config ``name`` and ``extra`` flags (none: saving
    into ``tmp/name``, its metrics in ``tmp/name.jsonl``)."""
    from megacp.train.cli import main

    os.environ["MASTER_PORT"] = str(port)  # a rendezvous of its own
    outputs = ["--save", str(tmp / name), "--metrics", str(tmp / f"{name}.jsonl")]
    return main(["--deepspeed_config", str(tmp / f"{name}.json"), "--model", str(tmp / "model"), "--corpus",
                 str(tmp / "corpus"), "--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--quiet", "--token-cache",
                 "none", *LORA, *(extra or outputs)])


def _runs(rank: int, world_size: int, tmp: Path, names: list[str], ports: list[int]) -> str | None:
    """The runs ``names``; at CP 1 first one whose target modules match nothing, which must end with
    exit status 2 and one line on stderr, returned."""
    refused = None
    if world_size == 1:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
            _main(tmp, free_port(), "cp1", "--lora-target-modules", "no_such_proj")
        assert exit_info.value.code == 2
        refused = err.getvalue()
    for name, port in zip(names, ports, strict=True):
        assert _main(tmp, port, name) == 0
    return refused


def _losses(tmp: Path, name: str) -> list[float]:
    return [json.loads(line)["loss"] for line in (tmp / f"{name}.jsonl").read_text().splitlines()]


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "adapter_model.safetensors")


def _peft_of_checkpoint(tmp: Path, name: str) -> Any:
    """The model of the DeepSpeed checkpoint ``tmp/name/step3`` (ZeRO 1: whole on rank 0), base and
    adapters, as a PEFT model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp / "model"),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    states = torch.load(tmp / name / f"step{STEPS}" / "mp_rank_00_model_states.pt", map_location="cpu",
                        weights_only=False)["module"]
    model.get_base_model().load_state_dict(states)
    return model.eval()


def test_lora_trains_the_same_at_cp1_and_cp2(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    make_tiny_model(tmp_path / "model")
    make_corpus(tmp_path / "corpus")
    _write_configs(tmp_path)
    refused = run_distributed(_runs, 1, tmp_path, ["cp1"], [free_port()], timeout=HANG_GUARD_S)[0]
    errors = [line for line in refused.splitlines() if line.startswith("megacp.train: error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"megacp.train: error: --model {tmp_path / 'model'}: LoRA "
                                                     "(LoRA r 8, alpha 16, dropout 0 on no_such_proj): Target "
                                                     "modules {'no_such_proj'} not found"), refused
    run_distributed(_runs, 2, tmp_path, ["cp2", "cp2_zero3"], [free_port(), free_port()], timeout=HANG_GUARD_S)

    reference = _losses(tmp_path, "cp1")
    assert len(reference) == STEPS and reference[0] != reference[-1]
    adapters = {name: _adapter(tmp_path / name) for name in ("cp1", "cp2", "cp2_zero3")}
    moved = [float(t.abs().max()) for key, t in adapters["cp1"].items() if "lora_B" in key]
    assert len(moved) == 2 * 7 and min(moved) > 0, "every linear layer of both layers has a trained adapter"
    for name in ("cp2", "cp2_zero3"):
        assert _losses(tmp_path, name) == pytest.approx(reference, rel=1e-5), name
        assert sorted(adapters[name]) == sorted(adapters["cp1"]), name
        # all adapters as one vector, with AdamW's tolerances of tests/distributed/test_train_equivalence.py
        got, want = (torch.cat([adapters[n][key].flatten() for key in sorted(adapters["cp1"])]) for n in (name, "cp1"))
        assert float((got - want).norm() / want.norm()) <= RTOL, name
        assert rel_err(got, want) <= ELEMENT_RTOL, name

    base = load_file(tmp_path / "model" / "model.safetensors")
    saved = torch.load(tmp_path / "cp2" / f"step{STEPS}" / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)
    frozen = {k.replace(".base_layer", ""): v for k, v in saved["module"].items() if ".lora_" not in k}
    assert sorted(frozen) == sorted(base) and all(torch.equal(frozen[k], base[k]) for k in base), "the base changed"
    trainable = sum(t.numel() for t in adapters["cp2"].values())
    partitions = 0
    for rank in range(2):
        optim = torch.load(tmp_path / "cp2" / f"step{STEPS}" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                           map_location="cpu", weights_only=False)["optimizer_state_dict"]
        partitions += sum(t.numel() for t in optim["single_partition_of_fp32_groups"]) - sum(optim["group_paddings"])
    assert partitions == trainable, "the optimizer holds states of frozen weights"

    ids = torch.arange(3, 3 + SEQ_LEN)[None]
    with torch.no_grad():
        want = _peft_of_checkpoint(tmp_path, "cp2")(ids).logits
        for name in ("cp2", "cp2_zero3"):
            reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "model"),
                                                 str(tmp_path / name)).eval()
            got = reloaded(ids).logits
            assert float((got - want).abs().max() / want.abs().max()) <= 1e-5, name


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--lora-r", "0"], "--lora-r must be an integer >= 1, got 0"),
        (["--lora-r", "8", "--lora-alpha", "0"], "--lora-alpha must be an integer >= 1, got 0"),
        (["--lora-r", "8", "--lora-dropout", "1.5"], "--lora-dropout must be in [0, 1), got 1.5"),
        (["--lora-alpha", "16"], "--lora-alpha needs --lora-r R, the rank of the LoRA adapters"),
        (["--lora-r", "8", "--lora-target-modules", "all-linear", "q_proj"],
         "--lora-target-modules all-linear already names every linear layer; give it alone"),
    ],
    ids=["r", "alpha", "dropout", "alpha_without_r", "all_linear_and_more"],
)
def test_bad_lora_flags_are_one_line(flags: list[str], expected: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from megacp.train.cli import main

    make_tiny_model(tmp_path / "model")
    make_corpus(tmp_path / "corpus")
    capsys.readouterr()  # the model's writing
    with pytest.raises(SystemExit) as exit_info:
        main(["--deepspeed_config", str(ROOT / "configs" / "train_cpu_cp1.json"), "--model", str(tmp_path / "model"),
              "--corpus", str(tmp_path / "corpus"), "--seq-len", str(SEQ_LEN), "--steps", "1", "--quiet", *flags])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_info.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("megacp.train: error: ") and expected in lines[0], lines


def test_lora_needs_a_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A .gguf file (or the default model) is refused before any load, naming how to get a directory."""
    from megacp.train.cli import main

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit):
        main(["--deepspeed_config", str(ROOT / "configs" / "train_cpu_cp1.json"), "--model", str(gguf),
              "--lora-r", "8"])
    err = capsys.readouterr().err.strip()
    assert err == (f"megacp.train: error: --lora-r trains PEFT adapters on a transformers model: --model must be a "
                   f"Hugging Face model directory with a config.json, got {gguf} (tools/convert_checkpoint.py "
                   "gguf-to-megacp, then megacp-to-hf, makes one of a .gguf file)")
