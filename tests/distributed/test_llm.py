"""``megacp.LLM`` against Hugging Face transformers (greedy, fp32, tiny Llama with a character-level
tokenizer saved next to it), and ``SamplingParams`` validation and sampling numbers.

The LLM is built inside each rank of a real gloo process group (CP = world size).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import hf_greedy, make_hf_model, save_char_tokenizer

NEW = 6

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    d = tmp_path_factory.mktemp("llm")
    model = make_hf_model("llama3", d)
    save_char_tokenizer(d)
    return str(d), model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (61, 9, 38)]


def _llm_body(rank: int, n: int, path: str, prompts: list[list[int]], ref_text: str) -> dict:
    from megacp import LLM, SamplingParams

    llm = LLM(path, dtype="float32")
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    stop_at = outs[0].token_ids[2]
    stopped = llm.generate(prompts[0], SamplingParams(max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    text = llm.generate("hello world", greedy)[0]
    stop = ref_text[2:4]
    cut = llm.generate("hello world", SamplingParams(max_tokens=NEW, ignore_eos=True, stop=[stop]))[0]
    pieces = list(llm.stream("hello world", SamplingParams(max_tokens=NEW, ignore_eos=True, stop=[stop])))
    chat = llm.chat([{"role": "user", "content": "hi"}], greedy)[0]
    penalised = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True, repetition_penalty=1.5))
    sampled = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0)
    unseeded = [llm.generate(prompts[0], sampled)[0].token_ids for _ in range(2)]
    seeded = [llm.generate(prompts[0], SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, seed=3))[0]
              .token_ids for _ in range(2)]
    assert unseeded[0] != unseeded[1] and seeded[0] == seeded[1]  # fresh draws unless seeded (same on every rank)
    for wrong, call in (("got a dict: pass SamplingParams", lambda: llm.generate("hi", {"max_tokens": 2})),
                        ("got a list holding a dict", lambda: llm.generate(["a", "b"], [greedy, {}])),
                        ("chat takes a conversation", lambda: llm.chat("a string"))):
        with pytest.raises(ValueError, match=wrong):
            call()
    with llm.session() as session:  # the chat template applied to the whole conversation, only the new part sent
        messages = [{"role": "user", "content": "hi"}]
        first = session.chat(messages, greedy)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
        second = session.chat(messages, greedy)
        conversation = (session.history, first.token_ids, second.prompt_token_ids, second.token_ids)
    return dict(tokens=[o.token_ids for o in outs], reasons=[o.finish_reason for o in outs],
                ttft=[o.ttft_s for o in outs], rates=[o.decode_tokens_per_s for o in outs],
                stopped=(stopped.token_ids, stopped.finish_reason, stop_at), text=(text.text, text.token_ids),
                cut=(cut.text, cut.finish_reason, stop), pieces=[(p.token_id, p.text, p.finish_reason) for p in pieces],
                chat=(chat.prompt_token_ids, chat.token_ids), report=llm.last_report,
                penalised=[o.token_ids for o in penalised], conversation=conversation)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_llm_generate_equals_transformers(n: int, tiny) -> None:
    """A batch of ragged token-id prompts, a text prompt, a chat, stop tokens, stop strings and the
    stream, at CP = n: every greedy token equals transformers' own generate."""
    from transformers import AutoTokenizer

    path, hf = tiny
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompts()
    expected = hf_greedy(hf, prompts, NEW)
    hello = tok("hello world")["input_ids"]
    hello_ref = hf_greedy(hf, [hello], NEW)[0]
    ref_text = tok.decode(hello_ref, skip_special_tokens=True)
    assert len(ref_text) >= 5, ref_text  # the random model writes characters, so stop strings can be cut from them
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert tok.decode(chat) == "U:hi.A:"
    chat_ref = hf_greedy(hf, [list(chat)], NEW)[0]
    penalised = hf_greedy(hf, prompts, NEW, repetition_penalty=1.5)
    turn2 = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": tok.decode(
        chat_ref, skip_special_tokens=True)}, {"role": "user", "content": "more"}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]
    assert turn2[: len(chat) + NEW] == list(chat) + chat_ref  # the reply re-tokenizes to the generated ids
    turn2_ref = hf_greedy(hf, [list(turn2)], NEW)[0]
    assert penalised != expected  # the penalty changes the greedy choice somewhere
    for got in run_distributed(_llm_body, n, path, prompts, ref_text):
        assert got["tokens"] == expected
        assert got["reasons"] == ["length"] * 3 and all(t > 0 for t in got["ttft"]) and all(r > 0 for r in got["rates"])
        tokens, reason, stop_at = got["stopped"]
        assert reason == "stop" and tokens == expected[0][: expected[0].index(stop_at) + 1]
        assert got["text"] == (ref_text, hello_ref)
        text, reason, stop = got["cut"]
        assert reason == "stop" and text == ref_text[: ref_text.index(stop)]
        assert "".join(p[1] for p in got["pieces"]) == text and got["pieces"][-1][2] == "stop"
        assert [p[0] for p in got["pieces"]] == hello_ref[: len(got["pieces"])]
        assert got["chat"] == (list(chat), chat_ref)
        assert got["report"]["cp_size"] == n
        assert got["penalised"] == penalised
        history, first, sent, second = got["conversation"]
        assert first == chat_ref and sent == turn2[len(chat) + NEW:] and second == turn2_ref
        assert history == list(turn2) + turn2_ref


def test_sampling_params_validate_each_value() -> None:
    from megacp import SamplingParams

    assert SamplingParams(max_new_tokens=7).max_tokens == 7 and SamplingParams(max_tokens=7).max_new_tokens == 7
    assert SamplingParams().max_tokens == 16 and SamplingParams(stop="x").stop == ("x",)
    bad = [
        (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        (dict(max_tokens=2.5), "max_tokens must be an integer >= 1, got 2.5"),
        (dict(max_tokens=3, max_new_tokens=4), "max_tokens=3 and its alias max_new_tokens=4 differ"),
        (dict(temperature=-0.1), "temperature must be >= 0 (0 = greedy), got -0.1"),
        (dict(temperature=math.nan), "temperature must be >= 0 (0 = greedy), got nan"),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(top_p=math.nan), "top_p must be in (0, 1], got nan"),
        (dict(top_k=-1), "top_k must be an integer >= 0 (0 = all tokens), got -1"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0 (1 = off), got 0.0"),
        (dict(stop=[""]), "stop must be non-empty strings, got ['']"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be integers >= 0, got [-1]"),
        (dict(seed=1.5), "seed must be an integer or None, got 1.5"),
    ]
    for kw, message in bad:
        with pytest.raises(ValueError) as err:
            SamplingParams(**kw)
        assert str(err.value) == message


def test_sampling_numbers() -> None:
    from megacp import SamplingParams
    from megacp.generate.sampling import penalise, sample

    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [1.0, 0.0, 0.0, 5.0]])
    for t in (1e-30, 1e-6):  # below the greedy floor: argmax, no NaN
        assert sample(logits * 1e30, SamplingParams(temperature=t)).tolist() == [1, 3]
    draws = {tuple(sample(logits * 100, SamplingParams(temperature=1e-4, seed=s)).tolist()) for s in range(5)}
    assert draws == {(1, 3)}  # a small temperature above the floor: finite, near-greedy
    top1 = {tuple(sample(logits, SamplingParams(temperature=5.0, top_k=1, seed=s)).tolist()) for s in range(10)}
    assert top1 == {(1, 3)}
    top2 = {sample(logits, SamplingParams(temperature=50.0, top_k=2, seed=s))[0].item() for s in range(40)}
    assert top2 == {1, 2}
    seen = torch.tensor([[True, True, False, True], [False, False, False, False]])
    none = torch.zeros(2, 4, dtype=torch.int32)
    pen = penalise(torch.tensor([[2.0, -2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0]]), seen, none, torch.tensor([2.0, 2.0]),
                   torch.zeros(2), torch.zeros(2))
    assert pen.tolist() == [[1.0, -4.0, 1.0, 0.25], [1.0, 1.0, 1.0, 1.0]]
    assert sample(logits, SamplingParams(repetition_penalty=2.0), [[0, 1, 3], []]).tolist() == [2, 3]


def _non_finite_body(rank: int, n: int, path: str) -> tuple[str, bool]:
    from megacp import LLM
    from megacp.checkpoint import CheckpointError

    try:
        LLM(path, dtype="float32")
        refused = ""
    except CheckpointError as err:
        refused = str(err)
    llm = LLM(path, dtype="float32", allow_non_finite=True)
    weight = dict(llm.generator.model.named_parameters())["layers.1.self_attention.layernorm_qkv.key_weight"]
    return refused, bool(torch.isnan(weight).any())


def test_llm_refuses_non_finite_weights_unless_allowed(tmp_path: Path) -> None:
    """A weight holding NaN: ``LLM`` refuses it naming the tensor; ``allow_non_finite=True`` (the
    CLIs' ``--allow-non-finite``) loads it as it is."""
    from safetensors.torch import load_file, save_file

    make_hf_model("llama3", tmp_path)
    save_char_tokenizer(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    state["model.layers.1.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(state, weights, metadata={"format": "pt"})
    refused, loaded_nan = run_distributed(_non_finite_body, 1, str(tmp_path))[0]
    assert "tensor 'layers.1.self_attention.layernorm_qkv.key_weight'" in refused and "holds 1 non-finite value" in refused
    assert loaded_nan


THREAD_CALLS = 4


def _thread_calls(thread: int) -> list[tuple[str, list[int], int]]:
    """The calls one thread makes: (kind, prompt, seed); thread 1 streams every other call."""
    g = torch.Generator().manual_seed(11 + thread)
    kinds = ["generate"] * THREAD_CALLS if thread == 0 else ["generate", "stream"] * (THREAD_CALLS // 2)
    return [(kind, torch.randint(3, 256, (5 + 7 * i + thread,), generator=g).tolist(), 100 * thread + i)
            for i, kind in enumerate(kinds)]


def _threads_body(rank: int, n: int, path: str) -> dict:
    """Every call of two threads alone, then the two threads at once on one LLM (each call's tokens
    or its error message), then one more call from the main thread (the ranks are still in step)."""
    import threading

    from megacp import LLM, SamplingParams

    llm = LLM(path, dtype="float32")

    def call(kind: str, prompt: list[int], seed: int) -> list[int]:
        params = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.8, seed=seed)
        if kind == "stream":
            return [piece.token_id for piece in llm.stream(prompt, params)]
        return llm.generate([prompt], params)[0].token_ids

    calls = [_thread_calls(t) for t in range(2)]
    alone = [[call(*c) for c in thread_calls] for thread_calls in calls]
    together: list[list] = [[], []]
    start = threading.Barrier(2)

    def run(t: int) -> None:
        start.wait()
        for c in calls[t]:
            try:
                together[t].append(call(*c))
            except ValueError as err:
                together[t].append(str(err))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return dict(alone=alone, together=together, after=call(*calls[0][0]))


@pytest.mark.parametrize("n", [1, 2])
def test_two_threads_on_one_llm_get_the_single_threaded_tokens(n: int, tiny) -> None:
    """Two threads x 4 calls (generate and streams) on one LLM: at CP 1 every call gives the tokens it
    gives alone; at CP 2 each call gives them or, where the threads' calls reached the two ranks in
    different orders, one error on every rank saying so; the ranks stay in step."""
    path, _ = tiny
    results = run_distributed(_threads_body, n, path)
    for rank, res in enumerate(results):
        assert res["alone"] == results[0]["alone"] and res["after"] == res["alone"][0][0]
        for t in range(2):
            assert len(res["together"][t]) == THREAD_CALLS
            for i, got in enumerate(res["together"][t]):
                if n == 1 or isinstance(got, list):
                    assert got == res["alone"][t][i], (rank, t, i, got)
                    continue
                kind = _thread_calls(t)[i][0]
                assert re.fullmatch(
                    rf"LLM\.{kind}: the 2 CP ranks must pass the same values but differ in call \(rank {rank} has "
                    rf"'{kind} [0-9a-f]{{16}}', rank\(s\) \[{1 - rank}\] another value\): every CP rank must make the "
                    r"same calls of its LLM in the same order \(calls from several threads reach the ranks in different "
                    r"orders: make them from one thread per rank\)", got), got
