"""The tokenizer and generation files that travel with a checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol, Union

from megacp.checkpoint.errors import CheckpointError

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


def load_tokenizer(source: TokenizerSource, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer :func:`~megacp.checkpoint.load.load_model` returned, ready to use: loaded
    from a directory with ``AutoTokenizer``, else the object itself (or ``None``).

    ``trust_remote_code`` is passed to transformers explicitly (default ``False``): a tokenizer
    whose ``auto_map`` names code of the checkpoint is refused rather than run or prompted for.

    Raises:
        CheckpointError: one of the directory's :data:`COMPANION_FILES` is a symlink leading outside
            it (:func:`check_companion_files`), before transformers reads any of them.
    """
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoTokenizer

        check_companion_files(Path(source))

        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    return source


def companion_file(source: Path, name: str, use: str = "copy") -> Path | None:
    """``source/name`` when it is a regular file inside ``source`` (a symlink is followed only while
    it stays inside ``source``), else ``None``; one that leads outside is a :class:`CheckpointError`
    (``use``: what was to be done with it, for the message)."""
    path = source / name
    if not path.is_file():
        return None
    if not path.resolve().is_relative_to(Path(source).resolve()):
        raise CheckpointError(f"{path} is a symlink leading outside the checkpoint {source}; refusing to {use} it")
    return path


def check_companion_files(source: Path) -> None:
    """Raise :class:`CheckpointError` when one of ``source``'s :data:`COMPANION_FILES` is a symlink
    leading outside ``source`` (what :func:`load_tokenizer` checks before transformers reads them)."""
    for name in COMPANION_FILES:
        companion_file(source, name, "read")


def write_tokenizer(source: TokenizerSource, directory: Path) -> None:
    """Put the tokenizer into ``directory``: copy the :data:`COMPANION_FILES` a source directory
    has, or call ``source.save_pretrained``; nothing for ``None``."""
    if source is None:
        return
    if hasattr(source, "save_pretrained"):
        source.save_pretrained(str(directory))
        return
    for name in COMPANION_FILES:
        path = companion_file(Path(source), name)
        if path is not None:
            shutil.copy2(path.resolve(), directory / name)
