"""The save directory of ``megacp.train``: ``--resume`` reads checkpoints of it only: a ``latest`` naming ``../other``, an
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


def test_the_disk_check_counts_the_kept_checkpoints_and_the_staged_one(tmp_path: Path) -> None:
    """--keep-last k holds k checkpoints plus the one being staged (less those already on the disk);
    without it every save stays; a file system without room for them is one line naming the count."""
    import torch

    from megacp.train.save_target import check_save_target, checkpoints_at_once, saved_tags
    from tests.helpers.training import tiny_config

    assert checkpoints_at_once(saves=10, keep_last=2, existing=0) == 3
    assert checkpoints_at_once(saves=10, keep_last=2, existing=2) == 1
    assert checkpoints_at_once(saves=1, keep_last=3, existing=0) == 1
    assert checkpoints_at_once(saves=5, keep_last=None, existing=4) == 5
    _tag(tmp_path / "save" / "step4")
    assert saved_tags(tmp_path / "save") == ["step4"]
    config = tiny_config(tied=False)
    check_save_target(tmp_path / "save", config, torch.float32, force=False, checkpoints=3)
    with pytest.raises(ValueError, match=r"1000000000 checkpoints at once \(kept and staged\) need about"):
        check_save_target(tmp_path / "save", config, torch.float32, force=False, checkpoints=10**9)


def test_a_save_directory_is_locked_by_one_run(tmp_path: Path) -> None:
    from megacp.train.save_target import SaveLock

    first = SaveLock(tmp_path / "save")
    with pytest.raises(ValueError, match=r"is in use by another run \(pid \d+ on .* since "):
        SaveLock(tmp_path / "save")
    del first
    SaveLock(tmp_path / "save")  # released with its holder
