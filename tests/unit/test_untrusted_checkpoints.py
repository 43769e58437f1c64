"""A DeepSpeed checkpoint is data: a pickle that would run code is refused before anything
unpickles it (the payload writes nothing), a tag that points outside the checkpoint is refused, and
the converter says so in one line with exit 2, creating no output."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from megacp.checkpoint import CheckpointError
from megacp.checkpoint.deepspeed import MegacpRecord, read_deepspeed_checkpoint, write_train_state
from megacp.models import ModelConfig

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64)


class _Payload:
    """Unpickling this runs ``exec``: it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def _checkpoint(root: Path, marker: Path, latest: str = "step1") -> Path:
    ckpt = root / "ckpt"
    (ckpt / "step1").mkdir(parents=True)
    write_train_state(ckpt, model=MegacpRecord.of(CFG).entry(), dtype=torch.float32, tp_size=1, zero_stage=0,
                      tag="step1", tokenizer=None)
    torch.save({"module": {"x": torch.zeros(1)}, "payload": _Payload(marker)}, ckpt / "step1" / "mp_rank_00_model_states.pt")
    (ckpt / "latest").write_text(latest)
    return ckpt


def test_a_pickle_payload_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    ckpt = _checkpoint(tmp_path, marker)
    with pytest.raises(CheckpointError, match="is not plain tensor data .*--trust-checkpoint"):
        read_deepspeed_checkpoint(ckpt)
    assert not marker.exists()


def test_a_tag_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran.txt"
    ckpt = _checkpoint(tmp_path, marker, latest="../elsewhere")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CheckpointError, match="checkpoint tag '../elsewhere' points outside the checkpoint directory"):
        read_deepspeed_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="points outside"):
        read_deepspeed_checkpoint(ckpt, tag=str(tmp_path / "elsewhere"))


def test_the_converter_refuses_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    from megacp.checkpoint.convert import main

    marker = tmp_path / "ran.txt"
    ckpt = _checkpoint(tmp_path, marker)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["deepspeed-to-hf", "--input", str(ckpt), "--output", str(tmp_path / "hf")])
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--trust-checkpoint" in lines[0], err.getvalue()
    assert not marker.exists() and not (tmp_path / "hf").exists()
