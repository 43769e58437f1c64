"""Sliding-window attention under ring CP (real gloo processes, fp32) against single-process
references with an explicit window mask, and megacp's windowed models against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.reference import naive_attention, packed_causal

CASES = [([40], 1), ([40], 3), ([37, 9, 24], 7), ([30], 64), ([33, 14], 12), ([20], 7), ([150], 64)]
"""(packed document lengths, window): one key, windows smaller than a shard, packed documents of
ragged lengths, a window longer than the sequence, sequences between the window and 4 x window."""


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


@pytest.mark.parametrize("n", [2, 3, 4])
def test_windowed_ring_backward_equals_autograd_of_reference(n: int) -> None:
    results = run_distributed(_grad_body, n)
    for i, (lens, window) in enumerate(CASES):
        q, k, v = (x.requires_grad_() for x in _inputs(lens, 10 + i))
        ref = packed_causal(q, k, v, lens, window=window)
        ref.backward(torch.randn(sum(lens), 4, 8, generator=torch.Generator().manual_seed(99)))
        for idx, o, dq, dk, dv in (r[i] for r in results):
            torch.testing.assert_close(o, ref.detach()[idx], atol=1e-5, rtol=1e-5)
            for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
                torch.testing.assert_close(got, want[idx], atol=1e-5, rtol=1e-5)


WINDOW = 4
"""The window of the cached-step bodies (decode runs far past it)."""


def _cached_steps(rank: int, n: int, prefill: str, seed: int, steps: list[tuple[int, int]],
                  cut: tuple[int, int] | None = None) -> list[float]:
    """Steps of one request through the CP-sharded cache, each adding positions ``[a, b)`` of
    ``steps`` (one position: a decode step), with ``cut = (after, length)``: the slot cut back to
    ``length`` tokens after step ``after``. Returns each step's largest error against the windowed
    reference over the keys ``[0, b)``."""
    import torch.distributed as dist

    from megacp.kv_cache import ShardedKVCache
    from megacp.layers.settings import CPSettings
    from megacp.layers.step import begin_step
    from megacp.parallel.ring import Ring

    torch.set_num_threads(1)
    settings = CPSettings(ring=Ring(dist.group.WORLD), prefill=prefill)
    end = steps[-1][1]
    q, k, v = _inputs([end], seed)
    cache = ShardedKVCache(num_layers=1, num_kv_heads=2, head_dim=8, max_requests=1, capacity=32, cp_size=n, cp_rank=rank)
    slot = cache.allocate()
    layer = type("L", (), {"layer_index": 0})()
    pos = torch.arange(end)
    errors = []
    with torch.no_grad():
        for i, (a, b) in enumerate(steps):
            step = begin_step(settings, cache, [slot], [b - a])
            idx = step.token_index() + a
            out = step.attend(layer, q[idx], k[idx], v[idx], None, WINDOW)
            step.commit()
            ref = naive_attention(q[idx], k[:b], v[:b], q_positions=pos[idx], k_positions=pos[:b], window=WINDOW)
            errors.append((out - ref).abs().max().item())
            if cut is not None and cut[0] == i:
                cache.truncate(slot, cut[1])
    return errors


def _decode_body(rank: int, n: int) -> list[float]:
    """A 23-token prompt prefilled in two chunks (13, then 10 over the cached 13), then 9 decode steps,
    each output against the reference over the whole history."""
    return _cached_steps(rank, n, "pass_q", 7, [(0, 13), (13, 23), *((t, t + 1) for t in range(23, 32))])


def test_windowed_decode_equals_reference() -> None:
    for errors in run_distributed(_decode_body, 2):
        assert max(errors) < 1e-5, errors


def _cut_body(rank: int, n: int, cut: int) -> list[float]:
    """A 13-token prefill cut back to ``cut`` tokens part-way through its step (as prefix reuse and a
    rolled-back turn do), then the prompt's next tokens up to 23 over the cached ones and 6 decode
    steps, each output against the reference over the whole history: the cut step's cached keys keep
    the places its load-balanced sharding gave them."""
    return _cached_steps(rank, n, "pass_kv", 11, [(0, 13), (cut, 23), *((t, t + 1) for t in range(23, 29))],
                         cut=(0, cut))


@pytest.mark.parametrize("cut", [8, 9])
def test_windowed_steps_after_a_cut_step_equal_reference(cut: int) -> None:
    """At CP 2 a 9-token prefix of the 13-token step is held 4 + 5 by the ranks where a 9-token step
    would put 5 + 4 (a plan from the shortened history refused the step), an 8-token prefix 4 + 4 at
    other positions than an 8-token step's (such a plan computed wrong outputs)."""
    for errors in run_distributed(_cut_body, 2, cut):
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


WINDOW_PROMPTS = {1: [3, 2], 7: [20, 9], 64: [100, 37]}
"""window -> prompt lengths: the first between the window and 4 x window (1 < 3 < 4, 7 < 20 < 28,
64 < 100 < 256), the second ragged (shorter than 2N at some N, or than the window)."""
MODEL_KINDS = {"mistral": dict(sliding_window="W"), "qwen2": dict(use_sliding_window=True, sliding_window="W",
                                                                  max_window_layers=1)}
"""Windowed configs (``"W"``: the window): Mistral windows every layer, Qwen2 its layer 1 only."""
PREFILLS = {"pass_kv": dict(strategy="pass_kv"), "pass_q": dict(strategy="pass_q"),
            "chunked": dict(strategy="pass_kv", prefill_chunk=8)}
DECODED = 6
"""Greedy tokens after the prompt: decode runs past every window of 1 and 7 (and, with the prompt, of 64)."""


def _window_model(kind: str, window: int) -> torch.nn.Module:
    from tests.helpers.hf_archs import make_model

    extra = {k: window if v == "W" else v for k, v in MODEL_KINDS[kind].items()}
    return make_model(kind, eos_token_id=None, **extra).eval()


def _recomputed_greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens, each from a full forward over the prompt and the tokens so far
    (its own sliding-window mask over the whole sequence, no cache). At window 1 transformers'
    cached ``generate`` departs from its own full forward after the first token (its sliding-window
    cache layer), so the full forward is the reference."""
    outs = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(new_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(prompt):])
    return outs


def _window_prompts(window: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(window)
    return [torch.randint(3, 64, (m,), generator=g).tolist() for m in WINDOW_PROMPTS[window]]


def _window_sizes_body(rank: int, n: int, root: str) -> dict[tuple[str, int, str], tuple[list[list[int]], list[str]]]:
    """Greedy tokens of megacp's own Mistral / Qwen2 (``LLM(directory)``) and of the transformers
    Mistral object (``LLM(model)``, the attention-interface path) for every window and prefill."""
    from megacp import LLM, SamplingParams, initialize, shutdown

    torch.set_num_threads(1)
    state = initialize()
    greedy = SamplingParams(max_tokens=DECODED, ignore_eos=True)
    out = {}
    for window in WINDOW_PROMPTS:
        prompts = _window_prompts(window)
        runs = [(f"own {kind}", f"{root}/{kind}{window}") for kind in MODEL_KINDS]
        runs.append(("hf mistral", _window_model("mistral", window)))
        for name, model in runs:
            for prefill, options in PREFILLS.items():
                llm = LLM(model, dtype="float32", state=state, **options)
                tokens = [o.token_ids for o in llm.generate(prompts, greedy)]
                out[(name, window, prefill)] = (tokens, llm.last_report["prefill_strategy"])
    shutdown()
    return out


@pytest.fixture(scope="module")
def window_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[tuple[str, int], list[list[int]]]]:
    """The windowed models saved (directory ``<kind><window>``) and transformers' greedy tokens for
    each (:func:`_recomputed_greedy`)."""
    from tests.distributed.test_llm import save_char_tokenizer

    root = tmp_path_factory.mktemp("windows")
    want = {}
    for window in WINDOW_PROMPTS:
        for kind in MODEL_KINDS:
            model = _window_model(kind, window)
            model.save_pretrained(root / f"{kind}{window}")
            save_char_tokenizer(root / f"{kind}{window}")
            want[(kind, window)] = _recomputed_greedy(model, _window_prompts(window), DECODED)
    return str(root), want


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_window_sizes_generate_as_transformers(n: int, window_models: tuple) -> None:
    """Windows of 1, 7 and 64 tokens, prompts between the window and 4 x window, CP 1-4: pass-KV,
    pass-Q and chunked prefill then decode past the window, through megacp's own Mistral and Qwen2
    and through the transformers Mistral object, token for token as transformers' greedy decoding."""
    root, want = window_models
    for (kind, window), tokens in want.items():
        assert len({t for row in tokens for t in row}) > 2, f"{kind} window {window}: the reference is degenerate"
    for rank, got in enumerate(run_distributed(_window_sizes_body, n, root)):
        for (name, window, prefill), (tokens, strategies) in got.items():
            assert tokens == want[(name.split()[1], window)], (n, rank, name, window, prefill)
            assert set(strategies) == {PREFILLS[prefill]["strategy"]}, (name, window, prefill, strategies)
