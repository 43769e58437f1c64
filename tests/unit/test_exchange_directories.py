"""Re-saving a training checkpoint's tag swaps the new directory in atomically where Linux can
(``renameat2`` ``RENAME_EXCHANGE``): both paths exist at every moment, with each other's contents after."""

from __future__ import annotations

from pathlib import Path

from megacp.checkpoint.staging import exchange_directories


def test_exchange_swaps_contents_or_changes_nothing(tmp_path: Path) -> None:
    a, b = tmp_path / "new", tmp_path / "step4"
    a.mkdir()
    b.mkdir()
    (a / "weights").write_text("new")
    (b / "weights").write_text("old")
    swapped = exchange_directories(a, b)
    contents = ((a / "weights").read_text(), (b / "weights").read_text())
    assert contents == (("old", "new") if swapped else ("new", "old"))
    assert not exchange_directories(tmp_path / "absent", b) and (b / "weights").exists()  # a failed call changes nothing
