"""Sliding-window attention under ring CP (real gloo processes, fp32) against single-process
references with an explicit window mask, and megacp's windowed models against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.reference import naive_attention, packed_causal

CASES = [([40], 1), ([40], 3), ([37, 9, 24], 7), ([30], 64), ([33, 14], 12)]
"""(packed document lengths, window): one key, windows smaller than a shard, packed documents of
ragged lengths, a window longer than the sequence."""


def _inputs(lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return torch.randn(t, 4, 8, generator=g), torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g)


def _prefill_body(rank: int, n: int) -> list[float]:
    from megacp.attention import cp_attention

    torch.set_num_threads(1)
    errors = []
    for i, (lens, window) in enumerate(CASES):
        q, k, v = _inputs(lens, i)
        ref = packed_causal(q, k, v, lens, window=window)
        cu = torch.tensor([0, *lens]).cumsum(0).int()
        for strategy in ("pass_kv", "pass_q"):
            out = cp_attention(q, k, v, cu_seqlens=cu, strategy=strategy, window=window)
            errors.append((out - ref).abs().max().item())
    return errors


@pytest.mark.parametrize("n", [2, 3, 4])
def test_windowed_ring_prefill_equals_reference(n: int) -> None:
    for errors in run_distributed(_prefill_body, n):
        assert max(errors) < 1e-5, errors


def _grad_body(rank: int, n: int) -> dict:
    import torch.distributed as dist

    from megacp.attention import ring_attention
    from megacp.parallel.ring import Ring
    from megacp.placement import ShardPlan

    torch.set_num_threads(1)
    out = {}
    for i, (lens, window) in enumerate(CASES):
        q, k, v = _inputs(lens, 10 + i)
        plan = ShardPlan([0] * len(lens), lens, n, rank).with_window(window)
        idx = plan.local_index()
        ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
        dout = torch.randn(sum(lens), 4, 8, generator=torch.Generator().manual_seed(99))
        o = ring_attention(ql, kl, vl, plan, Ring(dist.group.WORLD))
        o.backward(dout[idx])
        out[i] = (idx, o.detach(), ql.grad, kl.grad, vl.grad)
    return out


def test_windowed_ring_backward_equals_autograd_of_reference() -> None:
    results = run_distributed(_grad_body, 2)
    for i, (lens, window) in enumerate(CASES):
        q, k, v = (x.requires_grad_() for x in _inputs(lens, 10 + i))
        ref = packed_causal(q, k, v, lens, window=window)
        ref.backward(torch.randn(sum(lens), 4, 8, generator=torch.Generator().manual_seed(99)))
        for idx, o, dq, dk, dv in (r[i] for r in results):
            torch.testing.assert_close(o, ref.detach()[idx], atol=1e-5, rtol=1e-5)
            for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
                torch.testing.assert_close(got, want[idx], atol=1e-5, rtol=1e-5)


def _decode_body(rank: int, n: int) -> list[float]:
    """A 23-token prompt prefilled in two chunks (13, then 10 over the cached 13), then 9 decode steps
    through the CP-sharded cache (window 4: decode runs far past it), each output against the
    reference over the whole history."""
    import torch.distributed as dist

    from megacp.kv_cache import ShardedKVCache
    from megacp.layers.settings import CPSettings
    from megacp.layers.step import begin_step
    from megacp.parallel.ring import Ring

    torch.set_num_threads(1)
    settings = CPSettings(ring=Ring(dist.group.WORLD), prefill="pass_q")
    window, prompt, steps = 4, 23, 9
    q, k, v = _inputs([prompt + steps], 7)
    cache = ShardedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, max_requests=1, capacity=32, cp_size=n, cp_rank=rank)
    slot = cache.allocate()
    layer = type("L", (), {"layer_index": 0})()
    errors = []
    pos = torch.arange(prompt + steps)
    with torch.no_grad():
        for a, b in ((0, 13), (13, prompt)):
            step = begin_step(settings, cache, [slot], [b - a])
            idx = step.token_index() + a
            out = step.attend(layer, q[idx], k[idx], v[idx], None, window)
            step.commit()
            ref = naive_attention(q[idx], k[:b], v[:b], q_positions=pos[idx], k_positions=pos[:b], window=window)
            errors.append((out - ref).abs().max().item())
        for t in range(prompt, prompt + steps):
            step = begin_step(settings, cache, [slot], [1])
            out = step.attend(layer, q[t:t + 1], k[t:t + 1], v[t:t + 1], None, window)
            step.commit()
            ref = naive_attention(q[t:t + 1], k[:t + 1], v[:t + 1], q_positions=pos[t:t + 1], k_positions=pos[:t + 1],
                                  window=window)
            errors.append((out - ref).abs().max().item())
    return errors


def test_windowed_decode_equals_reference() -> None:
    for errors in run_distributed(_decode_body, 2):
        assert max(errors) < 1e-5, errors


def _llm_body(rank: int, n: int, paths: list[str], prompts: list[list[int]]) -> list[list[list[int]]]:
    from megacp import LLM, SamplingParams

    torch.set_num_threads(1)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    return [[o.token_ids for o in LLM(p, dtype="float32").generate(prompts, greedy)] for p in paths]


def test_windowed_models_generate_as_transformers(tmp_path: Path) -> None:
    """Mistral (window 5) and Qwen2 (window 7 on layer 1 only) at CP 2: prompts of 19 and 11 tokens,
    8 greedy tokens, equal to transformers' own generate with its sliding-window masks."""
    from tests.distributed.test_llm import save_char_tokenizer
    from tests.helpers.hf_models import hf_greedy, make_hf_model

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (m,), generator=g).tolist() for m in (19, 11)]
    paths, want = [], []
    for kind in ("mistral_window", "qwen2_window"):
        d = tmp_path / kind
        model = make_hf_model(kind, d)
        save_char_tokenizer(d)
        paths.append(str(d))
        want.append(hf_greedy(model, prompts, 8))
    for got in run_distributed(_llm_body, 2, paths, prompts):
        assert got == want
