"""The FP8 KV cache's storage format against a reference computed here: power-of-two scales per
(layer, request, K/V, head) from the request's first step, e4m3 rounding, clamping at ±448, the
scales kept by later steps and fixed anew after a truncation to nothing; the static decode step's
device-side writes and reads equal the host-planned ones; and the names ``kv_cache_dtype`` takes."""

from __future__ import annotations

import math

import pytest
import torch

from megacp.generate import Generator
from megacp.generate.cli import parse_args as generate_args
from megacp.kv_cache import ShardedKVCache, kv_cache_format
from megacp.layers.settings import CPSettings
from megacp.serve.cli import parse_args as serve_args

HKV, D = 2, 8


def _cache(n: int = 1, **kw: object) -> ShardedKVCache:
    return ShardedKVCache(num_layers=2, num_kv_heads=HKV, head_dim=D, max_requests=2, capacity=32, cp_size=n,
                          kv_cache_dtype="fp8_e4m3", **kw)  # type: ignore[arg-type]


def _step(cache: ShardedKVCache, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    plan = cache.plan([slot], [k.shape[0]])
    for layer in range(cache.num_layers):
        cache.write(layer, [slot], plan, k * (layer + 1), v * (layer + 1))
    cache.commit([slot], plan)


def _reference(x: torch.Tensor, amax: list[float]) -> tuple[torch.Tensor, list[float]]:
    """``x [n, Hkv, D]`` as the format stores it, given each head's first-step amax."""
    scales = [2.0 ** math.ceil(math.log2(4 * a / 448)) for a in amax]
    s = torch.tensor(scales)[:, None]
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s, scales


def _data(n: int, seed: int, mags: tuple[float, float]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, D, generator=g) * torch.tensor(mags)[:, None]


def test_writes_round_to_e4m3_with_the_first_steps_scales_and_clamp_later_overflow() -> None:
    cache = _cache()
    slot = cache.allocate()
    k, v = _data(7, 0, (1.0, 300.0)), _data(7, 1, (0.01, 5.0))
    _step(cache, slot, k, v)
    for layer in range(2):
        for w, x in enumerate((k, v)):
            x = x * (layer + 1)
            want, scales = _reference(x, x.abs().amax(dim=(0, 2)).tolist())
            assert cache.scales is not None and cache.scales[layer, slot, w].tolist() == scales
            got = cache.kv(layer, slot, 7)[w]
            assert got.dtype == torch.float32 and torch.equal(got, want)
            s = torch.tensor(scales)[:, None]
            assert bool(((got - x).abs() <= 2.0 ** -4 * x.abs() + 2.0 ** -10 * s).all())  # e4m3: half an ulp
    # a later step keeps the scales: 100x larger keys of head 0 clamp at 448 * scale, never inf/NaN
    before = cache.scales.clone()
    big = _data(3, 2, (100.0, 1.0))
    _step(cache, slot, big, big)
    assert torch.equal(cache.scales, before)
    k0 = cache.kv(0, slot, 10)[0][7:]
    want, scales = _reference(big, k.abs().amax(dim=(0, 2)).tolist())
    assert torch.equal(k0, want) and bool(torch.isfinite(k0).all())
    assert float(k0[:, 0].abs().max()) == 448 * scales[0] < float(big[:, 0].abs().max())
    # truncated to nothing, the next step is the request's first again: new scales
    cache.truncate(slot, 0)
    _step(cache, slot, k / 64, v / 64)
    assert torch.equal(cache.scales[:, slot], before[:, slot] / 64)


def test_the_static_steps_device_writes_and_reads_equal_the_planned_ones() -> None:
    planned, static = _cache(), _cache()
    prompts = [_data(5, 3, (2.0, 0.5)), _data(9, 4, (40.0, 1.0))]
    slots = [[c.allocate() for _ in prompts] for c in (planned, static)]
    for c, ss in zip((planned, static), slots):
        for s, x in zip(ss, prompts):
            _step(c, s, x, -x)
    new = _data(2, 5, (3.0, 3.0))  # one decode token per request, 1.5x the first's largest key of slot 0
    plan = planned.plan(slots[0], [1, 1])
    planned.write(0, slots[0], plan, new, -new)
    planned.commit(slots[0], plan)
    _, held, starts = static.decode_state(slots[1], "cpu")
    static.write_rows(0, starts + held, new, -new)
    k, v, rows = static.static_rows(0, starts)
    assert k.shape == (2 * static.capacity, HKV, D) and rows.tolist() == [0, static.capacity]
    pairs = planned.decode_kv(0, slots[0], [6, 10])  # ragged lengths: one (k, v) per request
    for b, (n, (ref_k, ref_v)) in enumerate(zip((6, 10), pairs)):
        assert torch.equal(k[rows[b] : rows[b] + n], ref_k) and torch.equal(v[rows[b] : rows[b] + n], ref_v)
    assert k.dtype == torch.float32 and static.k.dtype == torch.float8_e4m3fn
    batched = planned.decode_kv(0, slots[0], [5, 5])  # equal lengths of consecutive slots: one pair [B, L, Hkv, D]
    assert isinstance(batched, tuple) and batched[0].dim() == 4
    for b, s in enumerate(slots[0]):
        assert all(torch.equal(batched[w][b], planned.kv(0, s, 5)[w]) for w in (0, 1))


def test_kv_cache_dtype_names_and_refusals() -> None:
    assert kv_cache_format("auto", torch.bfloat16) == kv_cache_format("bfloat16", torch.bfloat16) == "auto"
    assert kv_cache_format("fp8", torch.float32) == kv_cache_format("fp8_e4m3", torch.float32) == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not one of auto, fp8, fp8_e4m3"):
        kv_cache_format("fp8_e5m2", torch.float32)
    with pytest.raises(ValueError, match="'bfloat16' differs from the model's dtype float32"):
        ShardedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_requests=1, capacity=4, kv_cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        Generator(torch.nn.Identity(), settings=CPSettings(), num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                  device=torch.device("cpu"), dtype=torch.float32, kv_cache_dtype="int8")
    for parse in (generate_args, serve_args):
        assert parse(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8" and parse([]).kv_cache_dtype == "auto"
    cache = _cache(2)  # under CP the first step's scales need the max over every rank
    slot = cache.allocate()
    plan = cache.plan([slot], [4])
    x = torch.ones(plan.num_local(), HKV, D)
    with pytest.raises(ValueError, match="needs amax_reduce"):
        cache.write(0, [slot], plan, x, x)
