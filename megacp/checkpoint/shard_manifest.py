"""The manifest of a ``megacp.train`` checkpoint tag: which run wrote it, on which mesh, and the
size and SHA-256 of every file in it, so that shards that do not belong together are refused
before they are merged.

:meth:`~megacp.train.engine.Trainer.save` writes :data:`MANIFEST_FILE` into each tag directory
(from global rank 0, after every rank has hashed its share of the files)::

    {"format": "megacp-deepspeed-manifest", "version": 1, "run_id": "3f0c9e1a2b4d5e6f", "tag": "step100",
     "mesh": {"world_size": 4, "dp": 2, "cp": 2, "tp": 1, "ep": 1, "zero_stage": 1},
     "train_state_sha256": "...",   # megacp_train.json's values (its "tag" aside), canonical JSON
     "files": {"mp_rank_00_model_states.pt": {"size": 123, "sha256": "..."}, ...}}

A DeepSpeed file's name carries its rank (``zero_pp_rank_<r>_mp_rank_<t>_optim_states.pt``), so
each file's digest binds its data to its place in the rank layout: a shard of another run (or
corrupt), two shards swapped or renamed, a missing or an extra ``.pt`` file, and an edited or
foreign ``megacp_train.json`` are each one :class:`CheckpointError` line (:func:`verify_tag`). The
manifest guards against accidents (mixed-up copies, edits, partial transfers), not an attacker, who
could rewrite it too; untrusted files are kept as data by the loader's own checks. A tag without a
manifest (written by an older megacp, or by DeepSpeed alone) is read with a one-line warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from megacp.checkpoint.errors import CheckpointError

log = logging.getLogger(__name__)

MANIFEST_FILE = "megacp_manifest.json"
"""In every tag directory ``megacp.train`` writes."""

FORMAT = "megacp-deepspeed-manifest"
FORMAT_VERSION = 1

_CHUNK = 16 << 20
"""Bytes read at a time while hashing a file."""


def canonical_sha256(value: object) -> str:
    """Hex SHA-256 of ``value`` as canonical JSON (sorted keys, no spaces): equal values, whatever
    their key order or layout in a file, have equal digests."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class FileDigest:
    """A file's ``size`` in bytes and hex ``sha256``."""

    size: int
    sha256: str


def file_digest(path: Path) -> FileDigest:
    """The :class:`FileDigest` of ``path`` (read in chunks)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileDigest(size, h.hexdigest())


@dataclass(frozen=True)
class Mesh:
    """The rank layout a checkpoint was saved from."""

    world_size: int
    dp: int
    cp: int
    tp: int
    ep: int
    zero_stage: int


def tag_files(tag_dir: Path) -> list[str]:
    """The names of the files directly in ``tag_dir`` (the manifest aside), sorted."""
    return sorted(p.name for p in tag_dir.iterdir() if p.name != MANIFEST_FILE and (p.is_file() or p.is_symlink()))


def digest_share(tag_dir: Path, names: Sequence[str], rank: int, world_size: int) -> dict[str, FileDigest]:
    """The digests of this rank's share of ``names`` (every ``world_size``-th from ``rank``), so that
    the ranks of a job hash a checkpoint's files in parallel."""
    return {name: file_digest(tag_dir / name) for name in names[rank::world_size]}


@dataclass(frozen=True)
class Manifest:
    """A tag's manifest (see the module docstring)."""

    run_id: str
    tag: str
    mesh: Mesh
    train_state_sha256: str
    files: dict[str, FileDigest]

    def write(self, tag_dir: Path) -> None:
        """Write :data:`MANIFEST_FILE` into ``tag_dir`` (atomically)."""
        body = {"format": FORMAT, "version": FORMAT_VERSION, "run_id": self.run_id, "tag": self.tag,
                "mesh": asdict(self.mesh), "train_state_sha256": self.train_state_sha256,
                "files": {name: asdict(d) for name, d in sorted(self.files.items())}}
        tmp = tag_dir / f".{MANIFEST_FILE}.tmp"
        tmp.write_text(json.dumps(body, indent=1), encoding="utf-8")
        tmp.replace(tag_dir / MANIFEST_FILE)

    @classmethod
    def read(cls, tag_dir: Path) -> Manifest | None:
        """``tag_dir``'s manifest, or ``None`` when it has none.

        Raises:
            CheckpointError: the manifest is unreadable or malformed (a file name in it that is not
                a plain name inside the tag directory included).
        """
        path = tag_dir / MANIFEST_FILE
        if not path.exists() and not path.is_symlink():
            return None
        try:
            if path.is_symlink():
                raise ValueError("a symbolic link")
            raw = json.loads(path.read_text(encoding="utf-8"))
            if raw.get("format") != FORMAT or raw.get("version") != FORMAT_VERSION:
                raise ValueError(f"not a {FORMAT} version {FORMAT_VERSION} file")
            files = {str(name): FileDigest(int(d["size"]), str(d["sha256"])) for name, d in raw["files"].items()}
            bad = [name for name in files if name in ("", ".", "..") or "/" in name or "\\" in name]
            if bad:
                raise ValueError(f"file name {bad[0]!r} is not a plain name")
            return cls(str(raw["run_id"]), str(raw["tag"]), Mesh(**raw["mesh"]), str(raw["train_state_sha256"]), files)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            raise CheckpointError(f"{path}: cannot be read ({type(err).__name__}: {err})") from None

    def check_layout(self, tag_dir: Path, train_state: Path, train_state_sha256: str) -> None:
        """Check what needs no hashing: ``train_state`` (the sidecar, whose values hash to
        ``train_state_sha256``) is the one the tag was saved with, every listed file is there as a
        regular file, and no ``.pt`` file is there unlisted.

        Raises:
            CheckpointError: one line naming the first problem.
        """
        if train_state_sha256 != self.train_state_sha256:
            raise CheckpointError(f"{train_state} does not match checkpoint {tag_dir.name} (its values differ from "
                                  f"the ones {MANIFEST_FILE} records): it was edited, or the tag belongs to another model")
        present = set(tag_files(tag_dir))
        for name in sorted(self.files):
            if (tag_dir / name).is_symlink():
                raise CheckpointError(f"{tag_dir / name} is a symbolic link; a checkpoint's files must be its own")
            if name not in present:
                raise CheckpointError(f"{tag_dir}: {name} is missing (run {self.run_id} saved it; {MANIFEST_FILE})")
        extra = sorted(name for name in present - set(self.files) if name.endswith(".pt"))
        if extra:
            raise CheckpointError(f"{tag_dir}: {extra[0]} is not part of checkpoint {self.tag} of run {self.run_id} "
                                  f"(not in {MANIFEST_FILE}); remove it if it came from another run")

    def check_digests(self, tag_dir: Path, digests: Mapping[str, FileDigest]) -> None:
        """Compare the listed files' ``digests`` (as read now) with the manifest's.

        Raises:
            CheckpointError: a file holds another listed file's data (ranks swapped or renamed),
                or data of no listed file (a shard of another run, or corrupt).
        """
        owners = {d: name for name, d in self.files.items()}
        for name in sorted(self.files):
            if digests[name] == self.files[name]:
                continue
            other = owners.get(digests[name])
            if other is not None:
                raise CheckpointError(f"{tag_dir}: {name} holds the data of {other} (shards swapped or renamed); "
                                      f"checkpoint {self.tag} of run {self.run_id} cannot be merged")
            raise CheckpointError(f"{tag_dir}: {name} does not belong to checkpoint {self.tag} of run {self.run_id} "
                                  f"(its size or SHA-256 differs from {MANIFEST_FILE}): a file of another run, or corrupt")


def warn_unchecked(tag_dir: Path) -> None:
    """Say in one line that ``tag_dir`` has no manifest, so its files are read unchecked."""
    log.warning("warning: %s has no %s (saved by an older megacp or by DeepSpeed alone): its shards are not "
                "checked to belong together", tag_dir, MANIFEST_FILE)


def verify_tag(tag_dir: Path, train_state: Path, train_state_sha256: str) -> Manifest | None:
    """Check every file of ``tag_dir`` against its manifest in this process (:meth:`Manifest.check_layout`,
    then each file's digest); a tag without a manifest passes with a one-line warning. Returns the
    manifest (``None`` when there is none).

    Raises:
        CheckpointError: the files do not belong together (one line).
    """
    manifest = Manifest.read(tag_dir)
    if manifest is None:
        warn_unchecked(tag_dir)
        return None
    manifest.check_layout(tag_dir, train_state, train_state_sha256)
    manifest.check_digests(tag_dir, digest_share(tag_dir, sorted(manifest.files), 0, 1))
    return manifest

