"""Saving and restoring a :class:`~megacp.train.engine.Trainer`'s run: DeepSpeed's checkpoint of
the engine plus what megacp adds (the sidecar its family records, the tag's manifest, the resume
point and every rank's generator states), staged so that a save killed part-way leaves the previous
checkpoint intact, and checked before a resume reads it (:class:`Checkpointing`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megacp.checkpoint.staging import exchange_directories
from megacp.config import TrainingConfig
from megacp.families import Trainable
from megacp.parallel.state import ParallelState
from megacp.train.resume import ResumePoint, load_rng_file, prune, rng_file, rng_state, set_rng_state

if TYPE_CHECKING:
    from megacp.checkpoint.shard_manifest import FileDigest, Manifest


class Checkpointing:
    """The saving half of :class:`~megacp.train.engine.Trainer` (which sets these attributes).

    Attributes:
        engine: the DeepSpeed engine; state: the mesh; training: the training config; model: the
            model as its family trains it; steps_done: optimizer steps so far; run_id: this run's
            identity in its checkpoints' manifests (a resumed run keeps the one it resumes);
            sharded_experts: whether experts are sharded over EP (such runs cannot save).
    """

    engine: Any
    state: ParallelState
    training: TrainingConfig
    model: Trainable
    steps_done: int
    run_id: str
    sharded_experts: bool

    def save(self, directory: str | Path, *, resume: ResumePoint | None = None, keep_last: int | None = None) -> str:
        """``engine.save_checkpoint(directory)`` (tag ``step<N>``, ZeRO shards included), plus, from
        global rank 0, the model description (what its family records,
        :meth:`~megacp.families.Trainable.record`) and tokenizer files that
        :func:`~megacp.checkpoint.deepspeed.read_deepspeed_checkpoint` needs. With ``resume``, the
        tag also gets what :meth:`load` restores (:mod:`megacp.train.resume`: the point and every
        rank's generator states); with ``keep_last``, only that many ``step<N>`` tags remain. The
        directory's ``zero_to_fp32.py`` is megacp's (:mod:`megacp.checkpoint.zero_to_fp32`: it
        writes a Hugging Face directory), not DeepSpeed's. The tag's manifest
        (:mod:`megacp.checkpoint.shard_manifest`: the run id, the mesh, every file's size and
        SHA-256, hashed by all ranks in parallel, and the checksum of the sidecar) is written into
        the staging directory last.
        Collective; returns the tag."""
        if self.sharded_experts:
            from megacp.train.experts import check_expert_saving

            check_expert_saving(self.state.size("ep"))
        tag = f"step{self.steps_done}"
        directory = Path(directory)
        staging = directory / f".{tag}.staging"
        if dist.get_rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()
        self._write_staging(directory, staging, tag, resume)
        dist.barrier()
        files = self._digests(staging / tag, None)
        if dist.get_rank() == 0:
            self._publish(directory, staging, tag, files, keep_last)
        dist.barrier()
        return tag

    def _write_staging(self, directory: Path, staging: Path, tag: str, resume: ResumePoint | None) -> None:
        """Every rank's files of ``tag`` into ``staging`` first: a save killed part-way leaves the
        previous checkpoint (its tag directory and the 'latest' naming it) untouched.

        Raises:
            CheckpointError: this rank's write failed (a full disk, say); the staging is removed.
        """
        try:
            self.engine.save_checkpoint(str(staging), tag=tag, save_latest=False)
            if resume is not None:
                torch.save(rng_state(), rng_file(staging / tag, dist.get_rank()))
                if dist.get_rank() == 0:
                    resume.write(staging / tag)
        except (OSError, RuntimeError) as err:
            from megacp.checkpoint.errors import CheckpointError

            shutil.rmtree(staging, ignore_errors=True)
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"saving {tag} into {directory} failed ({reason}); its staging directory is "
                                  "removed and the previous checkpoint is kept") from None

    def _publish(self, directory: Path, staging: Path, tag: str, files: dict[str, FileDigest],
                 keep_last: int | None) -> None:
        """Global rank 0: the manifest (``files``' digests and the sidecar's checksum) written into the
        staged tag last, the tag moved into place (a re-saved tag swapped atomically), the sidecar, the
        tokenizer files, megacp's ``zero_to_fp32.py``, then ``latest``; the oldest tags pruned to
        ``keep_last``."""
        from megacp.checkpoint import zero_to_fp32
        from megacp.checkpoint.deepspeed import train_state, train_state_sha256, write_train_state
        from megacp.checkpoint.shard_manifest import Manifest, Mesh

        state, stage, record = self.state, self.training.zero_stage, self.model.record()
        meta = train_state(model=record, dtype=self.training.dtype, tp_size=state.size("tp"), zero_stage=stage, tag=tag)
        mesh = Mesh(world_size=dist.get_world_size(), dp=state.size("dp"), cp=state.size("cp"), tp=state.size("tp"),
                    ep=state.size("ep"), zero_stage=stage)
        Manifest(self.run_id, tag, mesh, train_state_sha256(meta), files).write(staging / tag)
        old = directory / f".{tag}.old"
        shutil.rmtree(old, ignore_errors=True)
        if not (directory / tag).exists():
            os.replace(staging / tag, directory / tag)
        elif not exchange_directories(staging / tag, directory / tag):  # re-saving a tag: swapped atomically
            os.replace(directory / tag, old)  # where the system cannot swap: a kill here leaves it in .old
            os.replace(staging / tag, directory / tag)
        write_train_state(directory, model=record, dtype=self.training.dtype, tp_size=state.size("tp"),
                          zero_stage=stage, tag=tag, tokenizer=self.model.tokenizer)  # the values ``meta`` holds
        shutil.copyfile(zero_to_fp32.__file__, directory / zero_to_fp32.SCRIPT_NAME)  # HF files, not DeepSpeed's
        latest = directory / ".latest.tmp"
        latest.write_text(tag, encoding="utf-8")
        os.replace(latest, directory / "latest")  # 'latest' moves last
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        if keep_last is not None:
            prune(directory, keep_last, tag)

    def _digests(self, tag_dir: Path, names: list[str] | None) -> dict[str, FileDigest]:
        """The digests of ``names`` in ``tag_dir`` (``None``: every file there as global rank 0 lists
        it), each rank hashing its share. Collective."""
        from megacp.checkpoint.shard_manifest import digest_share, tag_files

        box = [names if names is not None else tag_files(tag_dir) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        shares: list[dict[str, FileDigest] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, digest_share(tag_dir, box[0] or [], dist.get_rank(), dist.get_world_size()))
        return {name: d for share in shares if share for name, d in share.items()}

    def _check_files(self, directory: Path, tag_dir: Path) -> Manifest | None:
        """Before resuming from ``tag_dir``: check it against its manifest, then that its ``.pt``
        files hold only data (DeepSpeed's loader unpickles them unguarded), each rank its share of
        the files; every rank raises the same error. Returns the manifest (``None`` for a tag
        without one). Collective."""
        from megacp.checkpoint.deepspeed import TRAIN_STATE_FILE, check_data_only, train_state_checksum
        from megacp.checkpoint.errors import CheckpointError
        from megacp.checkpoint.shard_manifest import Manifest, warn_unchecked

        manifest = Manifest.read(tag_dir)
        if manifest is None and dist.get_rank() == 0:
            warn_unchecked(tag_dir)
        if manifest is not None:
            manifest.check_layout(tag_dir, directory / TRAIN_STATE_FILE, train_state_checksum(directory))
            manifest.check_digests(tag_dir, self._digests(tag_dir, sorted(manifest.files)))
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            check_data_only(sorted(tag_dir.glob("*.pt"))[rank::world],
                            remedy="megacp.train resumes only from checkpoints of plain data")
            error = None
        except CheckpointError as err:
            error = str(err)
        errors: list[str | None] = [None] * world
        dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise CheckpointError(first)
        return manifest

    def load(self, directory: str | Path, tag: str) -> ResumePoint:
        """Restore checkpoint ``tag`` of ``directory`` (written by :meth:`save` with ``resume``):
        the model, optimizer and LR scheduler through ``engine.load_checkpoint``, this rank's
        generator states and the step count. Collective; returns the checkpoint's point (its
        ``data`` is where the next batch starts).

        Raises:
            CheckpointError: the tag lacks the resume files, its files do not match its manifest
                or are not plain data (checked by all ranks in parallel) or DeepSpeed finds no
                checkpoint.
        """
        from megacp.checkpoint.errors import CheckpointError

        tag_dir = Path(directory) / tag
        point = ResumePoint.read(tag_dir)
        manifest = self._check_files(Path(directory), tag_dir)
        if manifest is not None:
            self.run_id = manifest.run_id
        rng = load_rng_file(rng_file(tag_dir, dist.get_rank()))
        path, _ = self.engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint {tag} in {directory}")
        set_rng_state(rng)
        self.steps_done = point.step
        return point
