"""megacp's model against Hugging Face transformers (fp32, tiny random models of tests/hf_models.py).

Packed batches of several sequences, positions offset from 0 and non-contiguous, shuffled global
positions (as a CP rank holds them) are each compared to Hugging Face run on that sequence alone
with the same ``position_ids``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from megacp.checkpoint import CheckpointError, load_model, save_megacp_checkpoint
from megacp.models import CausalLM, ModelConfig, build_model, parameter_shapes
from megacp.models.build import resolve_backend
from megacp.models.rope import RotaryEmbedding, apply_rotary, rope_inv_freq
from megacp.models.te_model import check_te_supported, te_import_error
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import KINDS, make_hf_model

# The TP test's worker processes import this module: transformers is imported only inside tests.
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """kind -> (saved directory, the Hugging Face model) for every kind of tests/hf_models.py."""
    out = {}
    for kind in KINDS:
        directory = tmp_path_factory.mktemp(kind)
        out[kind] = (directory, make_hf_model(kind, directory))
    return out


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Hugging Face logits [T, V] of one sequence ``ids`` [T] at ``positions`` [T]."""
    with torch.no_grad():
        return hf(ids[None], position_ids=positions[None]).logits[0]


def _packed_batch(vocab: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three sequences (ids, positions): from 0; offset by 37; a shuffled non-contiguous subset."""
    g = torch.Generator().manual_seed(seed)
    lengths = (9, 13, 11)
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    positions = [
        torch.arange(lengths[0]),
        37 + torch.arange(lengths[1]),
        torch.randperm(3000, generator=g)[: lengths[2]],
    ]
    return ids, positions


# ----------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ],
    ids=lambda p: p["rope_type"],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_bitwise_equals_hf(params: dict, head_dim: int) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, rope_parameters=dict(params),
                         max_position_embeddings=131072)
    scaling = None if params["rope_type"] == "default" else params
    inv_freq = rope_inv_freq(head_dim, params["rope_theta"], scaling, 131072)
    hf_rope = LlamaRotaryEmbedding(hf_cfg)
    assert torch.equal(inv_freq, hf_rope.inv_freq)

    cfg = ModelConfig(hidden_size=4 * head_dim, num_heads=4, num_kv_heads=4,
                      rope_theta=params["rope_theta"], rope_scaling=scaling, max_position_embeddings=131072)
    positions = torch.tensor([0, 1, 5, 4095, 4096, 70000, 131071, 17])
    cos, sin = RotaryEmbedding(cfg)(positions)
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_apply_rotary_is_rotate_half_rotation() -> None:
    x = torch.randn(3, 2, 8)
    angle = torch.rand(3, 4)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    out = apply_rotary(x, cos, sin)
    a, b = x[..., :4], x[..., 4:]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    torch.testing.assert_close(out, torch.cat([a * c - b * s, b * c + a * s], -1))


def test_rope_rejects_unsupported_scaling() -> None:
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0}, 4096)


# ------------------------------------------------------------------------------- layout, errors


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_dict_is_the_checkpoint_layout(hf_dirs: dict, kind: str) -> None:
    model, cfg, _ = load_model(hf_dirs[kind][0], dtype=torch.float32, device="cpu")
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == parameter_shapes(cfg)
    assert ("lm_head.weight" in model.state_dict()) == (not cfg.tie_word_embeddings)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_bad_inputs_raise() -> None:
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    model = build_model(cfg, dtype=torch.float32, device="cpu", backend="torch")
    ids = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\[T\]"):
        model(ids[None], torch.arange(4)[None])
    with pytest.raises(ValueError, match="int32"):
        model(ids, torch.arange(4), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="backend"):
        build_model(cfg, dtype=torch.float32, device="cpu", backend="jax")


def test_load_model_rejects_unknown_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="neither"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")


# ---------------------------------------------------------------------------- logits against HF


@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_batch_matches_hf(hf_dirs: dict, kind: str) -> None:
    directory, hf = hf_dirs[kind]
    model, cfg, tokenizer = load_model(directory, dtype=torch.float32, device="cpu", backend="auto")
    assert isinstance(model, CausalLM) and tokenizer is None
    ids, positions = _packed_batch(cfg.vocab_size)
    lengths = [len(x) for x in ids]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        logits = model(torch.cat(ids), torch.cat(positions), cu_seqlens=cu_seqlens)
    assert logits.shape == (sum(lengths), cfg.vocab_size) and logits.dtype == torch.float32
    for seq_ids, seq_pos, got in zip(ids, positions, logits.split(lengths)):
        torch.testing.assert_close(got, _hf_logits(hf, seq_ids, seq_pos), atol=ATOL, rtol=RTOL)

    # The comparison is sensitive to positions: contiguous ones instead of the shuffled ones differ.
    with torch.no_grad():
        wrong = model(ids[2], torch.arange(lengths[2]))
    assert (wrong - logits[-lengths[2]:]).abs().max() > 1e-2


def test_logits_index_and_single_sequence(hf_dirs: dict) -> None:
    model, _, _ = load_model(hf_dirs["llama3"][0], dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(100, 120)
    with torch.no_grad():
        full = model(ids, positions)
        one_seq = model(ids, positions, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32))
        two_seqs = model(ids, positions, cu_seqlens=torch.tensor([0, 7, 20], dtype=torch.int32))
        last = model(ids, positions, cu_seqlens=torch.tensor([0, 7, 20], dtype=torch.int32),
                     logits_index=torch.tensor([6, 19]))
    assert torch.equal(full, one_seq)
    torch.testing.assert_close(last, two_seqs[[6, 19]], atol=1e-6, rtol=1e-6)
    assert (two_seqs[7:] - full[7:]).abs().max() > 1e-2  # the second sequence does not see the first


def test_bfloat16_error_is_within_hf_bfloat16_error(hf_dirs: dict) -> None:
    """bf16 megacp is as close to the fp32 reference as Hugging Face's own bf16 run is."""
    directory, hf = hf_dirs["qwen2"]
    model, _, _ = load_model(directory, dtype=torch.bfloat16, device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids, positions = _packed_batch(256, seed=3)
    with torch.no_grad():
        got = model(ids[2], positions[2])
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)(ids[2][None], position_ids=positions[2][None]).logits[0]
    ref = _hf_logits(hf, ids[2], positions[2])
    assert got.dtype == torch.bfloat16
    assert (got.float() - ref).abs().max() <= 1.5 * (hf_bf16.float() - ref).abs().max()


# ------------------------------------------------------------------------------------ checkpoints


def test_megacp_checkpoint_loads_like_hf(hf_dirs: dict, tmp_path: Path) -> None:
    directory, _ = hf_dirs["llama_tied"]
    model, cfg, _ = load_model(directory, dtype=torch.float32, device="cpu")
    save_megacp_checkpoint(tmp_path / "ckpt", cfg, model.state_dict().items(), dtype=torch.float32, tp_size=2)
    loaded, loaded_cfg, _ = load_model(tmp_path / "ckpt", dtype=torch.float32, device="cpu")
    assert loaded_cfg == cfg
    ids, positions = _packed_batch(cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(ids[1], positions[1]), model(ids[1], positions[1]))


def _tp_logits(rank: int, world_size: int, directory: str, ids: torch.Tensor, positions: torch.Tensor,
               cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Load with TP over the whole world and return the logits (identical on every rank)."""
    model, _, _ = load_model(directory, dtype=torch.float32, device="cpu",
                             tp_group=torch.distributed.group.WORLD)
    assert model.layers[0].self_attention.layernorm_qkv.query_weight.shape[0] == 64 // world_size
    with torch.no_grad():
        return model(ids, positions, cu_seqlens=cu_seqlens)


def test_tensor_parallel_matches_hf(hf_dirs: dict) -> None:
    directory, hf = hf_dirs["qwen2"]  # Q/K/V bias: biases are sharded too
    ids, positions = _packed_batch(256, seed=4)
    lengths = [len(x) for x in ids]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    results = run_distributed(_tp_logits, 2, str(directory), torch.cat(ids), torch.cat(positions), cu_seqlens)
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)
    for seq_ids, seq_pos, got in zip(ids, positions, results[0].split(lengths)):
        torch.testing.assert_close(got, _hf_logits(hf, seq_ids, seq_pos), atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- Transformer Engine


def test_backend_choice_without_te() -> None:
    qwen = ModelConfig(architecture="qwen2", hidden_size=64, num_heads=4, num_kv_heads=2, attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        check_te_supported(qwen)
    assert resolve_backend(qwen, "cuda") == "torch"
    assert resolve_backend(qwen, "cpu") == "torch"
    if te_import_error() is not None:
        with pytest.raises(RuntimeError, match="transformer_engine"):
            build_model(ModelConfig(num_layers=1), dtype=torch.float32, device="cpu", backend="te")


@pytest.mark.skipif(
    te_import_error() is not None or not torch.cuda.is_available(),
    reason=f"Transformer Engine on a CUDA device is needed ({te_import_error() or 'no CUDA device'})",
)
def test_te_backend_matches_torch_backend(hf_dirs: dict) -> None:
    directory, _ = hf_dirs["llama3"]
    torch_model, cfg, _ = load_model(directory, dtype=torch.bfloat16, device="cuda", backend="torch")
    te_model, _, _ = load_model(directory, dtype=torch.bfloat16, device="cuda", backend="te")
    te_keys = {k for k in te_model.state_dict() if not k.endswith("_extra_state")}
    assert te_keys == set(torch_model.state_dict())
    ids, positions = _packed_batch(cfg.vocab_size)
    lengths = [len(x) for x in ids]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    args = (torch.cat(ids).cuda(), torch.cat(positions).cuda())
    with torch.no_grad():
        ref = torch_model(*args, cu_seqlens=cu_seqlens).float()
        got = te_model(*args, cu_seqlens=cu_seqlens).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
