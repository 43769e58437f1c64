"""Census of untrusted-input and fault cases: each gives its one clear line and changes nothing
outside its target (a pickle payload that would write a file writes nothing, no file outside the
checkpoint is read)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megacp.checkpoint.deepspeed import MegacpRecord, read_deepspeed_checkpoint, write_train_state
from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.tokenizer_files import write_tokenizer
from megacp.models.schema import parameter_shapes
from tests.helpers.training import tiny_config


class _Payload:
    """Unpickling this calls ``os.system`` (what a malicious checkpoint would carry)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _checkpoint(root: Path, tag: str = "step1", module: object = None) -> Path:
    """A ``megacp.train`` style checkpoint without ZeRO shards: sidecar, ``latest``, module states."""
    config = tiny_config(tied=False)
    root.mkdir(parents=True, exist_ok=True)
    write_train_state(root, model=MegacpRecord.of(config).entry(), dtype=torch.float32, tp_size=1, zero_stage=0, tag=tag,
                      tokenizer=None)
    (root / tag).mkdir()
    if module is None:
        module = {name: torch.randn(shape) for name, shape in parameter_shapes(config).items()}
    torch.save({"module": module}, root / tag / "mp_rank_00_model_states.pt")
    (root / "latest").write_text(tag)
    return root


def test_plain_checkpoint_loads_as_data(tmp_path: Path) -> None:
    config = tiny_config(tied=False)
    tensors = {name: torch.randn(shape) for name, shape in parameter_shapes(config).items()}
    ckpt = read_deepspeed_checkpoint(_checkpoint(tmp_path / "ck", module=tensors))
    assert ckpt.tag == "step1"
    for name, tensor in tensors.items():
        torch.testing.assert_close(ckpt.tensors[name], tensor, rtol=0, atol=0)


def test_pickle_payload_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    root = _checkpoint(tmp_path / "ck", module={"evil": _Payload(marker)})
    with pytest.raises(CheckpointError) as err:
        read_deepspeed_checkpoint(root)
    message = str(err.value)
    assert "\n" not in message
    assert "mp_rank_00_model_states.pt is not plain tensor data" in message and "posix.system" in message
    assert "--trust-checkpoint" in message
    assert not marker.exists()
    from megacp.checkpoint.load import load_model  # where a model loads: the converter's flag is named as such

    with pytest.raises(CheckpointError, match="convert it with tools/convert_checkpoint.py deepspeed-to-hf "
                                              "--trust-checkpoint and load the converted directory"):
        load_model(root, dtype=torch.float32, device="cpu")
    assert not marker.exists()


@pytest.mark.parametrize("how", ["latest_dotdot", "tag_absolute", "tag_symlink"])
def test_tag_outside_the_checkpoint_is_refused(how: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    other = _checkpoint(tmp_path / "other", module={"evil": _Payload(marker)})
    root = _checkpoint(tmp_path / "ck")
    tag = None
    if how == "latest_dotdot":
        (root / "latest").write_text("../other/step1")
    elif how == "tag_absolute":
        tag = str(other / "step1")
    else:
        (root / "linked").symlink_to(other / "step1")
        tag = "linked"
    with pytest.raises(CheckpointError, match="points outside the checkpoint directory"):
        read_deepspeed_checkpoint(root, tag, trust=True)  # refused before anything is unpickled
    assert not marker.exists()


def test_tag_without_manifest_is_read_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = _checkpoint(tmp_path / "ck")
    with caplog.at_level("WARNING", logger="megacp.checkpoint.shard_manifest"):
        read_deepspeed_checkpoint(root)
    (record,) = caplog.records
    assert record.getMessage() == (f"warning: {(root / 'step1').resolve()} has no megacp_manifest.json (saved by an "
                                   "older megacp or by DeepSpeed alone): its shards are not checked to belong together")


def test_manifest_naming_a_file_outside_the_tag_is_refused(tmp_path: Path) -> None:
    import json

    from megacp.checkpoint.deepspeed import train_state_checksum

    marker = tmp_path / "pwned"
    root = _checkpoint(tmp_path / "ck")
    manifest = {"format": "megacp-deepspeed-manifest", "version": 1, "run_id": "r", "tag": "step1",
                "mesh": {"world_size": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1, "zero_stage": 0},
                "train_state_sha256": train_state_checksum(root),
                "files": {"../../other/step1/mp_rank_00_model_states.pt": {"size": 1, "sha256": "0"}}}
    _checkpoint(tmp_path / "other", module={"evil": _Payload(marker)})
    (root / "step1" / "megacp_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"megacp_manifest.json: cannot be read \(ValueError: file name "
                                              r"'../../other/step1/mp_rank_00_model_states.pt' is not a plain name\)$"):
        read_deepspeed_checkpoint(root)
    assert not marker.exists()


def test_symlinked_shard_outside_is_refused(tmp_path: Path) -> None:
    other = _checkpoint(tmp_path / "other")
    root = _checkpoint(tmp_path / "ck")
    shard = root / "step1" / "mp_rank_00_model_states.pt"
    shard.unlink()
    shard.symlink_to(other / "step1" / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="is a symbolic link; a checkpoint's files must be its own"):
        read_deepspeed_checkpoint(root)


def test_symlinked_companion_file_outside_is_not_copied(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    (source / "tokenizer.json").symlink_to(secret)
    with pytest.raises(CheckpointError, match="symlink leading outside the checkpoint"):
        write_tokenizer(source, target)
    assert list(target.iterdir()) == []


def test_symlinked_companion_file_outside_is_not_read(tmp_path: Path) -> None:
    from megacp.checkpoint.tokenizer_files import load_tokenizer

    (tmp_path / "secret.txt").write_text("not yours")
    source = tmp_path / "model"
    source.mkdir()
    (source / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(CheckpointError) as err:
        load_tokenizer(source)
    assert str(err.value) == (f"{source / 'tokenizer.json'} is a symlink leading outside the checkpoint {source}; "
                              "refusing to read it")


@pytest.mark.parametrize("how", ["empty_latest", "truncated_shard"])
def test_empty_latest_or_truncated_shard_is_one_line_saying_so(how: str, tmp_path: Path) -> None:
    """Where a model loads (and the converters read): an empty ``latest`` names no tag, a shard cut
    short is unreadable (not a file to trust)."""
    from megacp.checkpoint.load import load_model

    root = _checkpoint(tmp_path / "ck")
    shard = root / "step1" / "mp_rank_00_model_states.pt"
    if how == "empty_latest":
        (root / "latest").write_text("\n")
        message = f"{root / 'latest'} is empty: it names no checkpoint tag; pass --tag"
    else:
        shard.write_bytes(shard.read_bytes()[:1000])
        message = f"cannot read {shard} (1000 bytes; truncated or corrupt?): "
    for load in (lambda: read_deepspeed_checkpoint(root), lambda: load_model(root, dtype=torch.float32, device="cpu")):
        with pytest.raises(CheckpointError) as err:
            load()
        assert "\n" not in str(err.value) and str(err.value).startswith(message), str(err.value)
        assert how == "empty_latest" or "trust" not in str(err.value)


def test_symlinked_companion_file_inside_is_copied(tmp_path: Path) -> None:
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    (source / "real.json").write_text("{}")
    (source / "tokenizer.json").symlink_to(source / "real.json")
    write_tokenizer(source, target)
    assert (target / "tokenizer.json").read_text() == "{}" and not (target / "tokenizer.json").is_symlink()


def test_tokenizer_with_remote_code_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from megacp.checkpoint.tokenizer_files import load_tokenizer

    marker = tmp_path / "pwned"
    (tmp_path / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", null]}, "tokenizer_class": "EvilTokenizer"}')
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_tokenizer(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_sampling_string_boolean_is_refused(value: object) -> None:
    from megacp.generate.sampling import SamplingParams

    with pytest.raises(ValueError, match=f"ignore_eos must be True or False, got {value!r}"):
        SamplingParams(ignore_eos=value)  # type: ignore[arg-type]
    assert SamplingParams(ignore_eos=True).ignore_eos is True


@pytest.mark.parametrize("text", ["", "  \n\t"])
def test_empty_config_file_is_refused(text: str, tmp_path: Path) -> None:
    from megacp.config import ConfigError, load_config

    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"ds\.json: the config file is empty$"):
        load_config(path)


def test_save_target_checked_before_training(tmp_path: Path) -> None:
    """``--save`` refusals: unwritable directory, too little free space, another model's checkpoint."""
    import dataclasses
    import math

    from megacp.train.save_target import check_save_target, estimated_checkpoint_bytes

    config = tiny_config(tied=False)
    count = sum(math.prod(s) for s in parameter_shapes(config).values())
    assert estimated_checkpoint_bytes(config, torch.bfloat16) == count * (2 + 12)
    assert estimated_checkpoint_bytes(config, torch.float32) == count * (4 + 12)

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root writes anywhere
            with pytest.raises(ValueError, match=r"^--save .*/locked/ckpt: .*/locked is not writable$"):
                check_save_target(locked / "ckpt", config, torch.float32, force=False)
    finally:
        locked.chmod(0o700)

    huge = dataclasses.replace(config, vocab_size=2**31, hidden_size=2**20)  # petabytes: no disk holds it
    with pytest.raises(ValueError, match=r"^--save .*: the checkpoint needs about [\d,]+ MiB, .* has [\d,]+ MiB free$"):
        check_save_target(tmp_path / "ckpt", huge, torch.float32, force=False)

    _checkpoint(tmp_path / "other")
    other_model = dataclasses.replace(config, num_layers=1)
    with pytest.raises(ValueError, match=r"^--save .*/other holds a checkpoint of a different model "
                                         r"\(megacp_train.json\); use --force to save over it$"):
        check_save_target(tmp_path / "other", other_model, torch.float32, force=False)
    check_save_target(tmp_path / "other", other_model, torch.float32, force=True)
    check_save_target(tmp_path / "other", config, torch.float32, force=False)  # the same model: a re-save


def test_generate_output_written_atomically(tmp_path: Path) -> None:
    """``--output`` is replaced whole or not at all, and no temporary file stays behind."""
    from megacp.generate.cli import write_atomically

    out = tmp_path / "out.json"
    out.write_text("old")
    write_atomically(out, '{"tokens": [1]}')
    assert out.read_text() == '{"tokens": [1]}'
    with pytest.raises(UnicodeEncodeError):
        write_atomically(out, "\ud800")  # a lone surrogate cannot be encoded: fails part-way
    assert out.read_text() == '{"tokens": [1]}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_generate_output_directory_refused_before_generation(tmp_path: Path) -> None:
    from megacp.generate.cli import UsageError, parse_args, validate

    with pytest.raises(UsageError, match=r"^--output .* is a directory$"):
        validate(parse_args(["--prompt", "hi", "--output", str(tmp_path)]))
    validate(parse_args(["--prompt", "hi", "--output", str(tmp_path / "out.json")]))


def test_second_job_on_a_busy_launcher_port() -> None:
    """A second launched job on a busy ``MASTER_PORT``: its rank 0 gets one line naming the port and
    how to pick another; its rank 1, a client of the first job's store, reads and writes its own
    keys only (the whole case runs through the ``deepspeed`` launcher in
    tests/jobs/test_deepspeed_launch.py)."""
    import socket
    from datetime import timedelta

    from megacp.config import ConfigError
    from megacp.parallel.state import launcher_store
    from tests.helpers.distributed import free_port

    timeout = timedelta(seconds=10)
    with socket.socket() as busy:  # another process's listener (a store of this process would be shared)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            launcher_store({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}, 1002, timeout)
    assert str(caught.value) == (f"MASTER_PORT={port}: the port is in use on 127.0.0.1 (another job?); start this job "
                                 "on a free port: deepspeed --master_port P ... or torchrun --master-port P ...")
    launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    first = launcher_store({**launcher, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1"}, 1001, timeout)
    foreign = launcher_store({**launcher, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_SIZE": "2"}, 1002, timeout)
    first.set("0/rank_1", "first job")
    foreign.set("0/rank_1", "second job")
    assert first.get("0/rank_1") == b"first job" and foreign.get("0/rank_1") == b"second job"
    with pytest.raises(ConfigError, match="^RANK and WORLD_SIZE are set but MASTER_PORT not; a launcher sets all four$"):
        launcher_store({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, 1002, timeout)
