"""What a prefill chunk allocates beside the weights and the KV cache (CPU, counted by
:class:`~tests.helpers.memory.TensorMemory`): nothing that grows with the cached prefix (the KV
block of one request is a view of its cache rows; the reference attention converts keys block by
block), per token less than :data:`~megacp.generate.loop.PREFILL_WIDTHS` says (so no ``[T, V]``
logits and no untiled ``[T, 2F]`` MLP), and a cache of exactly the rows the run needs."""

from __future__ import annotations

import pytest
import torch

import megacp
import megacp.models.llama as llama
from megacp.generate import Generator
from megacp.generate.loop import MIN_AUTO_CHUNK, PREFILL_WIDTHS, auto_prefill_chunk
from megacp.layers.settings import CPSettings
from megacp.models import build_model
from megacp.models.config import ModelConfig
from megacp.models.ops import rms_norm, swiglu
from tests.helpers.memory import TensorMemory

CFG = ModelConfig(vocab_size=4096, hidden_size=64, intermediate_size=1024, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=8192)
TILE = 64
"""The MLP tile of these tests (the real one, 8192 tokens, is longer than their chunks)."""


@pytest.fixture(scope="module")
def gen() -> Generator:
    torch.manual_seed(0)
    model = build_model(CFG, dtype=torch.float32, device="cpu", backend="torch")
    settings = CPSettings(prefill="pass_kv")
    megacp.swap_attention(model, settings)
    return Generator.for_model(model, CFG, settings, device=torch.device("cpu"), dtype=torch.float32)


def _last_chunk_peak(gen: Generator, prefix: int, chunk: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, torch.Tensor]:
    """Peak bytes allocated while prefilling ``chunk`` tokens on top of ``prefix`` cached ones (the
    cache's rows of the prefix are taken as they are: their values do not change what a chunk
    allocates), and the logits returned."""
    monkeypatch.setattr(llama, "INFERENCE_TILE_TOKENS", TILE)
    prompt = torch.randint(0, CFG.vocab_size, (chunk,), generator=torch.Generator().manual_seed(1)).tolist()
    cache, slots = gen.batch_cache([[0] * prefix + prompt], 2)
    cache.commit(slots, cache.plan(slots, [prefix]))
    with torch.inference_mode(), TensorMemory() as mem:
        logits, _ = gen.prefill(cache, slots, [prompt])
    return mem.peak, logits


def test_chunk_transient_does_not_grow_with_the_prefix(gen: Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same 256-token chunk after 2048 and after 4096 cached tokens allocates the same bytes
    (before, the KV block copied the prefix and the reference kernel made fp32 copies of it; its
    score blocks, two of 1024 keys at once, are the same in both)."""
    short, _ = _last_chunk_peak(gen, 2048, 256, monkeypatch)
    long, logits = _last_chunk_peak(gen, 4096, 256, monkeypatch)
    assert logits.shape == (1, CFG.vocab_size)
    assert long == short, (short, long)


def test_chunk_transient_per_token_within_the_auto_chunk_bound(gen: Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Doubling the chunk from 1024 to 2048 tokens (after 2048 cached ones: the reference kernel's
    scratch is the same in both) adds less than ``PREFILL_WIDTHS`` elements per token: [T, V]
    logits would add 4096, an untiled MLP 4096 (gate/up, silu, product), against a bound of
    6·64 + 4·32 = 512; and more than q, k, v and the attention output (the count is real)."""
    small, _ = _last_chunk_peak(gen, 2048, 1024, monkeypatch)
    large, _ = _last_chunk_peak(gen, 2048, 2048, monkeypatch)
    per_token = (large - small) / 1024 / 4  # fp32 elements
    q, kv = CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
    assert 2 * q + 2 * kv <= per_token <= PREFILL_WIDTHS[0] * q + PREFILL_WIDTHS[1] * kv, per_token


def test_logits_of_selected_rows_equal_full_logits(gen: Generator) -> None:
    """``logits_index`` norms and projects only the chosen rows; they equal those rows of the full
    logits (to fp32 rounding)."""
    ids = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(40)
    with torch.inference_mode():
        model = llama.CausalLM(CFG)
        full = model(ids, pos)
        rows = model(ids, pos, logits_index=torch.tensor([39, 7]))
    assert rows.shape == (2, CFG.vocab_size)
    torch.testing.assert_close(rows, full[[39, 7]])  # BLAS rounds a 2-row product differently


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_mlp_runs_tiled_without_autograd(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without autograd a 512-token input runs the MLP in 64-token tiles: nothing of ``[512, 2F]``
    is allocated (the largest tensor is a tile's gate/up), and the output is the untiled one."""
    monkeypatch.setattr(llama, "INFERENCE_TILE_TOKENS", TILE)
    torch.manual_seed(3)
    mlp = llama.LayerNormMLP(CFG)
    torch.nn.init.normal_(mlp.fc1_weight, std=0.05)
    torch.nn.init.normal_(mlp.fc2_weight, std=0.05)
    mlp.layer_norm_weight.data.fill_(1.0)
    x = torch.randn(512, CFG.hidden_size)
    with getattr(torch, mode)():
        with TensorMemory() as mem:
            y = mlp(x)
        ref = swiglu(rms_norm(x, mlp.layer_norm_weight, mlp.eps), mlp.fc1_weight, mlp.fc2_weight)
    assert mem.largest[0][0] == TILE * 2 * CFG.intermediate_size * 4, mem.largest
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_batch_cache_holds_exactly_the_rows_of_the_run(gen: Generator) -> None:
    """512 prompt tokens in 128-token chunks and 4 new tokens need 512 + 3 rows at CP = 1 (the last
    token is not fed back), plus the static decode step's spare row: 516 (it was 652)."""
    chunked = Generator.for_model(gen.model, CFG, gen.settings, device=torch.device("cpu"), dtype=torch.float32,
                                  prefill_chunk=128)
    cache, slots = chunked.batch_cache([[1] * 512, [2] * 100], 4)
    assert cache.capacity == 516 and len(slots) == 2


def test_auto_prefill_chunk() -> None:
    """The documented formula: Llama-3.1-8B's shape (32 / 8 heads of 128, bf16) with 125 GiB free
    takes 56 KiB per token and 12.5 GiB, so 2^17 tokens; twice that under CP = 2; a floor when
    memory is short. On CPU a generator keeps whole-prompt prefill."""
    shape = dict(num_heads=32, num_kv_heads=8, head_dim=128, elem_bytes=2)
    assert auto_prefill_chunk(125 << 30, **shape) == 131072
    assert auto_prefill_chunk(125 << 30, cp_size=2, **shape) == 262144
    assert auto_prefill_chunk(1 << 30, **shape) == MIN_AUTO_CHUNK
    model = build_model(CFG, dtype=torch.float32, device="meta", backend="torch")
    cpu = Generator.for_model(model, CFG, CPSettings(), device=torch.device("cpu"), dtype=torch.float32)
    assert cpu.prefill_chunk == 0
