"""The tokenizer and generation files that travel with a checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol, Union

# Files a tokenizer or generation setup needs; copied between checkpoint directories as they are.
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class SavesPretrained(Protocol):
    """Anything with a Hugging Face style ``save_pretrained`` (e.g. a tokenizer object)."""

    def save_pretrained(self, save_directory: str) -> Any: ...


TokenizerSource = Union[str, os.PathLike, SavesPretrained, None]


def load_tokenizer(source: TokenizerSource) -> Any:
    """The tokenizer :func:`~megacp.checkpoint.load.load_model` returned, ready to use: loaded
    from a directory with ``AutoTokenizer``, else the object itself (or ``None``)."""
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    return source


def write_tokenizer(source: TokenizerSource, directory: Path) -> None:
    """Put the tokenizer into ``directory``: copy the :data:`COMPANION_FILES` a source directory
    has, or call ``source.save_pretrained``; nothing for ``None``."""
    if source is None:
        return
    if hasattr(source, "save_pretrained"):
        source.save_pretrained(str(directory))
        return
    for name in COMPANION_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, directory / name)
