"""megacp's sections of the DeepSpeed config: parsing, defaults, one-line errors, mesh sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megacp import ConfigError, MegacpConfig, ParallelLayout, load_config
from megacp.config import with_env_overrides
from tests.helpers.paths import CONFIGS

# file name -> (world size it is meant for, expected layout)
SHIPPED = {
    "cp2.json": (2, ParallelLayout(cp=2)),
    "cp4.json": (4, ParallelLayout(cp=4)),
    "cp2_ep2_moe.json": (4, ParallelLayout(cp=2, dp=2)),
    "cp2_tp2.json": (4, ParallelLayout(cp=2, tp=2)),
    "cp2_tp2_dp2_ep.json": (8, ParallelLayout(cp=2, tp=2, dp=2)),
    "cpu_demo.json": (2, ParallelLayout(cp=2)),
    "train_cp1.json": (1, ParallelLayout()),
    "train_cp2.json": (2, ParallelLayout(cp=2)),
    "train_cp2_zero2.json": (2, ParallelLayout(cp=2)),
    "train_cpu_cp1.json": (1, ParallelLayout()),
    "train_cpu_cp2.json": (2, ParallelLayout(cp=2)),
    "train_long_cp1.json": (1, ParallelLayout()),
}
CPU_CONFIGS = ("cpu_demo.json", "train_cpu_cp1.json", "train_cpu_cp2.json")  # fp32 on CPU: bf16 off


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
    assert ParallelLayout.from_config(cfg, 4) == ParallelLayout(dp=4)
    assert MegacpConfig() == load_config({})


def test_full_section_and_deepspeed_keys_kept() -> None:
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "whatever": [1, 2]},
        "context_parallel": {"size": 4, "prefill": "pass_q", "decode": "allgather", "load_balance": False},
        "tensor_model_parallel": {"size": 2},
        "pipeline_model_parallel": {"size": 1},
        "expert_model_parallel": {"size": None, "include_cp": True},
        "external_data_parallel": {"size": 1},
        "runtime": {"attention_backend": "reference", "ring_transport": "nccl", "peer_window_mb": 64,
                    "calibration_cache_dir": "/tmp/c", "timeout_minutes": 0.5},
        "tensor_parallel": {"autotp_size": 0},
    }
    cfg = load_config(raw)
    assert cfg.context_parallel.prefill == "pass_q" and cfg.context_parallel.load_balance is False
    assert cfg.deepspeed == raw and cfg.deepspeed is not raw
    assert ParallelLayout.from_config(cfg, 8) == ParallelLayout(cp=4, tp=2, ep_includes_cp=True)
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
        ({"context_paralel": {"size": 2}},
         "context_paralel: unknown top-level key; did you mean context_parallel?"),
        ({"Context_Parallel": {"size": 2}},
         "Context_Parallel: unknown top-level key; did you mean context_parallel?"),
        ({"context_parallelism": {"size": 2}},
         'context_parallelism: megacp reads the CP size only as {"context_parallel": {"size": N}}'),
        ({"cp": 2}, 'cp: megacp reads the CP size only as {"context_parallel": {"size": N}}'),
        ({"context_parallel_size": 2},
         'context_parallel_size: megacp reads the CP size only as {"context_parallel": {"size": N}}'),
        ({"megacp": {"context_parallel": {"size": 2}}},
         "megacp: megacp's sections sit at the top level of the DeepSpeed config (context_parallel, runtime, ...)"),
        ({"sequence_parallel_size": 2},
         "sequence_parallel_size: DeepSpeed's Ulysses sequence-parallel size; megacp splits sequences by context "
         'parallelism instead: set {"context_parallel": {"size": N}} and remove this key'),
        ({"tensor_model_paralel": {"size": 2}},
         "tensor_model_paralel: unknown top-level key; did you mean tensor_model_parallel?"),
        ({"pipeline_model_parallel": {"size": 2}},
         "pipeline_model_parallel.size: got 2; no megacp model has pipeline stages; allowed values: 1"),
        ({"context_parallel": {"size": float("inf")}},
         "context_parallel.size: got inf; allowed values: an integer >= 1"),
        ({"runtime": {"timeout_minutes": 0}},
         "runtime.timeout_minutes: got 0; allowed values: a finite number > 0"),
        ({"runtime": {"ring_transport": "tcp"}},
         "runtime.ring_transport: got 'tcp'; allowed values: 'auto', 'nccl', 'copy_engine'"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}},
         "bf16.enabled and fp16.enabled are both true; enable at most one"),
        ({"bf16": {"enabled": "yes"}}, "bf16.enabled: got 'yes'; allowed values: true, false"),
    ],
)
def test_error_messages(raw: dict, message: str) -> None:
    assert error_of(raw) == message
    assert "\n" not in message


def test_world_size_not_divisible() -> None:
    cfg = load_config({"context_parallel": {"size": 3}, "tensor_model_parallel": {"size": 2}})
    with pytest.raises(ConfigError) as info:
        ParallelLayout.from_config(cfg, 8)
    assert str(info.value) == (
        "context_parallel.size x tensor_model_parallel.size x pipeline_model_parallel.size = 3 x 2 x 1 = 6 "
        "does not divide the world size 8; allowed: sizes whose product divides 8"
    )
    assert ParallelLayout.from_config(cfg, 12) == ParallelLayout(cp=3, tp=2, dp=2)


def test_expert_size_must_match_mesh() -> None:
    cfg = load_config({"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2},
                       "expert_model_parallel": {"size": 1}})
    with pytest.raises(ConfigError) as info:
        ParallelLayout.from_config(cfg, 8)
    assert str(info.value) == (
        "expert_model_parallel.size: 1 does not match the expert-parallel group of "
        "ext_dp1 x dp2 x pp1 x cp2 x tp2 = 8 ranks (dp x tp = 4 ranks); allowed value: 4"
    )
    with_cp = load_config({"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2},
                           "expert_model_parallel": {"include_cp": True}})
    layout = ParallelLayout.from_config(with_cp, 8)
    assert layout.ep_includes_cp and [len(g) for g in layout.groups("ep")] == [8]


def test_number_out_of_range_in_file(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text('{"context_parallel": {"size": 1e400}}')
    assert error_of(path) == f"{path}: a number is out of range (cannot convert float infinity to integer)"


def test_deepspeed_precision_sections_give_the_dtype() -> None:
    assert load_config({}).dtype_name is None
    assert load_config({"bf16": {"enabled": True}}).dtype_name == "bfloat16"
    assert load_config({"fp16": {"enabled": True}, "bf16": {"enabled": False}}).dtype_name == "float16"


def test_environment_overrides_the_runtime_section() -> None:
    cfg = load_config({"runtime": {"ring_transport": "nccl", "peer_window_mb": 8}})
    env = {"MEGACP_ATTN_BACKEND": "flash", "MEGACP_PEER_WINDOW_MB": "64", "MEGACP_CACHE_DIR": "/tmp/cal",
           "MEGACP_RING_TRANSPORT": ""}
    runtime = with_env_overrides(cfg, env).runtime
    assert (runtime.attention_backend, runtime.ring_transport, runtime.peer_window_mb,
            runtime.calibration_cache_dir) == ("flash", "nccl", 64, "/tmp/cal")
    assert with_env_overrides(cfg, {}) is cfg
    for var, value, allowed in (("MEGACP_ATTN_BACKEND", "magic", "'auto', 'cudnn', 'flash', 'reference'"),
                                ("MEGACP_RING_TRANSPORT", "tcp", "'auto', 'nccl', 'copy_engine'"),
                                ("MEGACP_PEER_WINDOW_MB", "1.5", "an integer >= 1"),
                                ("MEGACP_PEER_WINDOW_MB", "0", "an integer >= 1")):
        with pytest.raises(ConfigError) as info:
            with_env_overrides(cfg, {var: value})
        assert str(info.value) == f"{var}={value!r}: allowed values: {allowed}"


def test_external_data_parallel_is_the_outermost_axis() -> None:
    cfg = load_config({"context_parallel": {"size": 2}, "external_data_parallel": {"size": 2}})
    assert ParallelLayout.from_config(cfg, 8) == ParallelLayout(cp=2, dp=2, ext_dp=2)
    with pytest.raises(ConfigError, match=r"x external_data_parallel.size = 2 x 1 x 1 x 2 = 4 does not divide "
                                          r"the world size 6"):
        ParallelLayout.from_config(cfg, 6)


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
        ParallelLayout.from_config(load_config(path), 4)


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
    assert ParallelLayout.from_config(cfg, world) == layout
    raw = json.loads((CONFIGS / name).read_text())
    assert raw["bf16"]["enabled"] is (name not in CPU_CONFIGS)
    assert cfg.dtype_name == (None if name in CPU_CONFIGS else "bfloat16")
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without a GPU")
@pytest.mark.parametrize("kernels", ["cudnn", "flash"])
def test_a_cuda_attention_backend_without_a_gpu_is_refused_before_any_work(kernels: str) -> None:
    """Refused by initialize, before the process group starts (it would fail in the first step)."""
    import torch.distributed as dist

    import megacp

    with pytest.raises(ConfigError, match=rf"runtime.attention_backend: '{kernels}' runs on CUDA GPUs"):
        megacp.initialize({"runtime": {"attention_backend": kernels}})
    assert not dist.is_initialized()


def test_deepspeed_sections_are_read_once_into_one_view() -> None:
    """Precision and ZeRO placement come from one reader (the trainer, the memory plan and the dtype of
    generation all take them from it), with one-line refusals of malformed values."""
    from megacp.config import DeepSpeedSections
    from megacp.train.memory import ZeroSettings

    raw = {"bfloat16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    view = DeepSpeedSections.read(raw)
    assert view == DeepSpeedSections("bfloat16", True, 3, True, True, True)
    settings = load_config(raw, training=True).training
    assert settings.sections == view and settings.dtype == torch.bfloat16 and settings.zero_stage == 3
    zero = ZeroSettings.of(settings.sections, partition=2, dtype=settings.dtype)
    assert (zero.stage, zero.offload_param, zero.offload_optimizer, zero.bf16_optimizer_states) == (3, True, True, True)
    assert load_config(raw).dtype_name == "bfloat16"
    assert DeepSpeedSections.read({"csv_monitor": {"enabled": True}, "wandb": {"enabled": False}}).monitors == ("csv_monitor",)
    for bad, message in (({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage: got '3'"),
                         ({"zero_optimization": {"reduce_scatter": "no"}}, "zero_optimization.reduce_scatter: got 'no'"),
                         ({"zero_optimization": {"offload_param": "cpu"}}, "zero_optimization.offload_param: expected an object"),
                         ({"bf16": True}, "bf16: expected an object, got True")):
        with pytest.raises(ConfigError, match=message):
            DeepSpeedSections.read(bad)
