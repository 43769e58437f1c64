"""``--resume`` reads checkpoints of its save directory only: a ``latest`` naming ``../other``, an
absolute path, or a tag that is a link out of the directory is refused in one line (as the converters
and ``--model`` refuse them); a tag inside is found."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megacp.checkpoint import CheckpointError
from megacp.train.resume import RESUME_FILE, locate


def _tag(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / RESUME_FILE).write_text("{}")
    return directory


@pytest.mark.parametrize("latest", ["../elsewhere/step5", "/elsewhere/step5", "linked"])
def test_tags_outside_the_save_directory_are_refused(tmp_path: Path, latest: str) -> None:
    save, outside = tmp_path / "save", _tag(tmp_path / "elsewhere" / "step5")
    save.mkdir()
    os.symlink(outside, save / "linked")
    (save / "latest").write_text(latest)
    for resume in ("auto", str(save)):
        with pytest.raises(CheckpointError, match=f"the checkpoint tag '{latest}' lies outside {save}"):
            locate(resume, str(save))
    with pytest.raises(CheckpointError, match="the checkpoint tag 'linked' lies outside"):
        locate(str(save / "linked"), str(save))


def test_a_tag_inside_is_found(tmp_path: Path) -> None:
    save = tmp_path / "save"
    _tag(save / "step3")
    (save / "latest").write_text("step3\n")
    assert locate("auto", str(save)) == locate(str(save), None) == locate(str(save / "step3"), None) == (save, "step3")
    assert locate("auto", str(tmp_path / "fresh")) is None
