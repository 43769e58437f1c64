"""megacp's sections of the DeepSpeed config: parsing, defaults, one-line errors, mesh sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megacp import ConfigError, MegacpConfig, ParallelLayout, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# file name -> (world size it is meant for, expected layout)
SHIPPED = {
    "cp2.json": (2, ParallelLayout(cp=2)),
    "cp4.json": (4, ParallelLayout(cp=4)),
    "cp2_tp2.json": (4, ParallelLayout(cp=2, tp=2)),
    "cp2_tp2_dp2_ep.json": (8, ParallelLayout(cp=2, tp=2, dp=2)),
    "cpu_demo.json": (2, ParallelLayout(cp=2)),
}


def error_of(source: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source)  # type: ignore[arg-type]
    return str(info.value)


def test_defaults() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1})
    cp = cfg.context_parallel
    assert (cp.size, cp.prefill, cp.decode, cp.load_balance) == (1, "auto", "allgather", True)
    assert cfg.tensor_model_parallel.size == 1 and cfg.pipeline_model_parallel.size == 1
    assert cfg.expert_model_parallel.size is None and cfg.expert_model_parallel.include_cp is False
    assert cfg.deepspeed == {"train_micro_batch_size_per_gpu": 1}
    assert cfg.layout(4) == ParallelLayout(dp=4)
    assert MegacpConfig() == load_config({})


def test_full_section_and_deepspeed_keys_kept() -> None:
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "whatever": [1, 2]},
        "context_parallel": {"size": 4, "prefill": "pass_q", "decode": "allgather", "load_balance": False},
        "tensor_model_parallel": {"size": 2},
        "pipeline_model_parallel": {"size": 1},
        "expert_model_parallel": {"size": 8, "include_cp": True},
        "tensor_parallel": {"autotp_size": 0},
    }
    cfg = load_config(raw)
    assert cfg.context_parallel.prefill == "pass_q" and cfg.context_parallel.load_balance is False
    assert cfg.deepspeed == raw and cfg.deepspeed is not raw
    assert cfg.layout(8) == ParallelLayout(cp=4, tp=2, ep_includes_cp=True)
    assert load_config(cfg) is cfg


def test_frozen() -> None:
    cfg = load_config({"context_parallel": {"size": 2}})
    with pytest.raises(ValueError, match="frozen"):  # pydantic's ValidationError is a ValueError
        cfg.context_parallel.size = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"context_parallel": {"size": 2, "prefil": "auto"}},
         "context_parallel.prefil: unknown key; allowed keys: size, prefill, decode, load_balance"),
        ({"tensor_model_parallel": {"size": 2, "sequence_parallel": True}},
         "tensor_model_parallel.sequence_parallel: unknown key; allowed keys: size"),
        ({"context_parallel": {"size": "2"}},
         "context_parallel.size: got '2'; allowed values: an integer >= 1"),
        ({"context_parallel": {"size": 2.0}},
         "context_parallel.size: got 2.0; allowed values: an integer >= 1"),
        ({"context_parallel": {"size": True}},
         "context_parallel.size: got True; allowed values: an integer >= 1"),
        ({"context_parallel": {"load_balance": "yes"}},
         "context_parallel.load_balance: got 'yes'; allowed values: true, false"),
        ({"context_parallel": 2},
         "context_parallel: expected an object with keys size, prefill, decode, load_balance, got 2"),
        ({"context_parallel": {"size": 0}},
         "context_parallel.size: got 0; allowed values: an integer >= 1"),
        ({"tensor_model_parallel": {"size": -2}},
         "tensor_model_parallel.size: got -2; allowed values: an integer >= 1"),
        ({"pipeline_model_parallel": {"size": 0}},
         "pipeline_model_parallel.size: got 0; allowed values: an integer >= 1"),
        ({"expert_model_parallel": {"size": 0}},
         "expert_model_parallel.size: got 0; allowed values: an integer >= 1 or null"),
        ({"context_parallel": {"prefill": "ring"}},
         "context_parallel.prefill: got 'ring'; allowed values: 'auto', 'pass_kv', 'pass_q'"),
        ({"context_parallel": {"decode": "pass_q"}},
         "context_parallel.decode: got 'pass_q'; allowed values: 'allgather'"),
        ({"tensor_parallel": {"size": 2}},
         "tensor_parallel.size: 'tensor_parallel' is DeepSpeed's own section; "
         "megacp reads this setting as tensor_model_parallel.size"),
        ({"expert_parallel": {"size": 4}},
         "expert_parallel.size: 'expert_parallel' is DeepSpeed's own section; "
         "megacp reads this setting as expert_model_parallel.size"),
        ({"pipeline_parallel": {"size": 2}},
         "pipeline_parallel: megacp reads this section as pipeline_model_parallel"),
    ],
)
def test_error_messages(raw: dict, message: str) -> None:
    assert error_of(raw) == message
    assert "\n" not in message


def test_world_size_not_divisible() -> None:
    cfg = load_config({"context_parallel": {"size": 3}, "tensor_model_parallel": {"size": 2}})
    with pytest.raises(ConfigError) as info:
        cfg.layout(8)
    assert str(info.value) == (
        "context_parallel.size x tensor_model_parallel.size x pipeline_model_parallel.size = 3 x 2 x 1 = 6 "
        "does not divide the world size 8; allowed: sizes whose product divides 8"
    )
    assert cfg.layout(12) == ParallelLayout(cp=3, tp=2, dp=2)


def test_expert_size_must_match_mesh() -> None:
    cfg = load_config({"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2},
                       "expert_model_parallel": {"size": 8}})
    with pytest.raises(ConfigError) as info:
        cfg.layout(8)
    assert str(info.value) == (
        "expert_model_parallel.size: 8 does not match the expert-parallel group of "
        "ext_dp1 x dp2 x pp1 x cp2 x tp2 = 8 ranks (dp x tp = 4 ranks); allowed value: 4"
    )
    with_cp = load_config({"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2},
                           "expert_model_parallel": {"size": 8, "include_cp": True}})
    layout = with_cp.layout(8)
    assert layout.ep_includes_cp and [len(g) for g in layout.groups("ep")] == [8]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    assert error_of(path) == f"{path}: config file not found"
    assert error_of(str(path)) == f"{path}: config file not found"


def test_unparseable_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"context_parallel": {"size": 2,, }}')
    message = error_of(path)
    assert message.startswith(f"{path}: not valid JSON/hjson: ") and "line 1" in message
    assert "\n" not in message


def test_duplicate_key_in_file(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"context_parallel": {"size": 2, "size": 4}}')
    assert error_of(path) == f"{path}: not valid JSON/hjson: duplicate key 'size'"


def test_top_level_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert error_of(path) == f"{path}: <top level>: expected a JSON object, got list"
    assert error_of(42) == "config: expected a path, a dict or a MegacpConfig, got int"


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"context_parallel": {"prefill": "ring"}}))
    assert error_of(path) == f"{path}: context_parallel.prefill: got 'ring'; allowed values: 'auto', 'pass_kv', 'pass_q'"
    path.write_text(json.dumps({"context_parallel": {"size": 3}}))
    with pytest.raises(ConfigError, match=rf"^{path}: context_parallel.size x .* does not divide the world size 4"):
        load_config(path).layout(4)


def test_hjson_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.hjson"
    path.write_text("{\n  # comments and unquoted strings are hjson\n  context_parallel: {\n"
                    "    size: 2\n    prefill: pass_q\n  }\n  train_micro_batch_size_per_gpu: 1\n}\n")
    cfg = load_config(path)
    assert cfg.context_parallel.size == 2 and cfg.context_parallel.prefill == "pass_q"
    assert cfg.source == str(path) and cfg.deepspeed["train_micro_batch_size_per_gpu"] == 1


def test_config_error_is_value_error_and_one_line() -> None:
    assert issubclass(ConfigError, ValueError)
    assert str(ConfigError("a\n  b")) == "a b"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs(name: str) -> None:
    world, layout = SHIPPED[name]
    cfg = load_config(CONFIGS / name)
    assert cfg.layout(world) == layout
    raw = json.loads((CONFIGS / name).read_text())
    assert raw["bf16"]["enabled"] is (name != "cpu_demo.json")
    assert cfg.deepspeed == raw


def test_every_shipped_config_is_listed() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.json")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_are_valid_deepspeed_configs(name: str) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed: cannot check its view of the configs")
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = DeepSpeedConfig(str(CONFIGS / name))
    assert ds.train_micro_batch_size_per_gpu == 1


def test_tensor_parallel_size_breaks_deepspeed_itself() -> None:
    """Why megacp's TP section is not called ``tensor_parallel``: DeepSpeed rejects ``size`` there."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed: cannot check its view of the configs")
    from deepspeed.runtime.config import DeepSpeedConfig

    with pytest.raises(Exception, match="size"):
        DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"size": 2}})
