"""Re-saving a training checkpoint under the same tag (a run repeated into its own ``--save``
directory) replaces the tag with the new weights and leaves no staging or old directory; a save whose
writes fail ends in one line and leaves the previous checkpoint as it was."""

from __future__ import annotations

import torch

from tests.helpers.distributed import run_distributed


def _resave(rank: int, world_size: int, directory: str) -> tuple[list[str], float, float]:
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    from pathlib import Path

    import megacp
    from megacp.checkpoint.deepspeed import read_deepspeed_checkpoint
    from megacp.models import CausalLM, ModelConfig
    from megacp.train.data import PackedSequence
    from megacp.train.engine import Trainer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    state = megacp.initialize(config)
    torch.manual_seed(0)
    trainer = Trainer(CausalLM(cfg, dtype=torch.float32).train(), config, state)
    trainer.save(directory)
    first = read_deepspeed_checkpoint(directory).tensors["embedding.weight"].clone()
    ids = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(1))
    trainer.step(iter([PackedSequence(ids, torch.tensor([0, 16], dtype=torch.int32))]))
    trainer.steps_done = 0  # the run repeated into its own directory: the same tag, step0, again
    trainer.save(directory)
    saved = read_deepspeed_checkpoint(directory).tensors["embedding.weight"]
    trained = trainer.module.embedding.weight.detach()
    names = sorted(p.name for p in Path(directory).iterdir())
    # a save whose writes fail (its staging path cannot take the files): one line, the checkpoint kept
    from megacp.checkpoint import CheckpointError

    trainer.steps_done = 1
    (Path(directory) / ".step1.staging").write_text("not a directory")
    try:
        trainer.save(directory)
        failure = ""
    except CheckpointError as err:
        failure = str(err)
    kept = read_deepspeed_checkpoint(directory)
    return (names, float((saved - trained).abs().max()), float((first - trained).abs().max()), failure,
            kept.tag, float((kept.tensors["embedding.weight"] - saved).abs().max()))


def test_resaving_a_tag_replaces_it(tmp_path):
    names, diff, moved, failure, kept_tag, kept_diff = run_distributed(_resave, 1, str(tmp_path / "ckpt"))[0]
    assert diff == 0.0 and moved > 0  # the tag holds the trained weights, not the first save's
    assert "step0" in names and not any(n.startswith(".") for n in names), names
    assert failure.startswith(f"saving step1 into {tmp_path / 'ckpt'} failed (") and "\n" not in failure, failure
    assert "the previous checkpoint is kept" in failure and kept_tag == "step0" and kept_diff == 0.0
