"""The batched sampler (:class:`megacp.generate.sampling.Sampler`) and the incremental stop-string
check against independent references: top-k / top-p / min-p masks against transformers' logits
warpers on random logits, penalties against transformers' ``RepetitionPenaltyLogitsProcessor``
and a plain PyTorch presence / frequency rule token for token, seeded draws that follow the
softmax and do not depend on the batch around them, and :class:`~megacp.generate.outputs.StopStrings`
against searching the whole decoded text after every token (a byte-level BPE tokenizer whose
token streams split UTF-8 characters)."""

from __future__ import annotations

import os

import pytest
import torch

from megacp.generate.sampling import (
    Sampler,
    SamplingParams,
    chunked_cumsum,
    kept_start,
    logprob_dicts,
    min_p_floor,
)

CPU = torch.device("cpu")


def filter_sorted(ordered: torch.Tensor, top_k: torch.Tensor | None, top_p_floor: torch.Tensor | None) -> torch.Tensor:
    """The masks :func:`~megacp.generate.sampling.kept_start` stands for: temperature-scaled
    logits sorted ascending ``[B, V]`` fp32 with the tokens each row's top-k and top-p drop set to
    ``-inf``, as Hugging Face's ``TopKLogitsWarper`` and ``TopPLogitsWarper`` in turn (one token
    at least survives; ``None`` skips a filter for every row)."""
    if top_k is not None:
        kth = ordered.gather(-1, (ordered.shape[-1] - top_k)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p_floor is not None:
        drop = chunked_cumsum(ordered.softmax(-1)) <= top_p_floor[:, None]
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    return ordered


def _hf_warped(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    x = TemperatureLogitsWarper(p.temperature)(None, row[None].clone())
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(None, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(None, x)
    if p.min_p:
        x = MinPLogitsWarper(p.min_p)(None, x)
    return x[0]


@pytest.mark.parametrize("seed, vocab", [(0, 400), (1, 400), (2, 400), (3, 5000)])
def test_filters_equal_transformers_warpers(seed: int, vocab: int) -> None:
    """Vocabulary 5000: the top-p cut's cumulative sum spans several of its 1,024-column chunks."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in [
        (0.7, 0, 0.9, 0.0), (1.0, 40, 1.0, 0.0), (1.3, 0, 1.0, 0.1), (0.5, 100, 0.8, 0.05),
        (1.0, 0, 1.0, 0.0), (2.0, 7, 0.5, 0.0), (0.9, 0, 0.95, 0.2), (1.1, 300, 0.3, 0.0)]]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), vocab, generator=g) * 3
    s = Sampler(params, vocab, CPU)
    ordered, index = (logits / s.temperature[:, None]).sort(dim=-1)
    ordered = filter_sorted(ordered, s.top_k, s.top_p_floor)
    ordered = ordered.masked_fill(ordered < min_p_floor(ordered[:, -1], s.log_min_p)[:, None], float("-inf"))
    ours = torch.empty_like(logits).scatter(-1, index, ordered)
    for row, p in enumerate(params):
        ref = _hf_warped(logits[row], p)
        assert torch.equal(ours[row].isinf(), ref.isinf()), (row, p)
        kept = ~ref.isinf()
        assert torch.allclose(ours[row][kept], ref[kept]), row
    dropped = ours.isinf().sum(-1)
    assert dropped[4] == 0 and all(0 < d < vocab for i, d in enumerate(dropped.tolist()) if i != 4), dropped


def _filter_case(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted rows of flat to peaked logits (scales 0.1-10) with ties, their top-k and top-p floors."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.1, 1.0, 3.0, 10.0, 0.5, 2.0, 5.0, 1.0])
    logits = (torch.randn(len(scale), vocab, generator=g) * scale[:, None]).round(decimals=2)  # ties
    top_k = torch.tensor([vocab, 40, vocab, 7, 300, vocab, 1, 2000]).clamp(max=vocab)
    floor = torch.tensor([0.1, 0.0, 0.5, 0.2, 0.05, 0.7, 0.1, 0.0])  # 1 - top_p
    return logits.sort(dim=-1, stable=True)[0], top_k, floor


@pytest.mark.parametrize("vocab", [1000, 5000, 49152])
def test_kept_start_is_the_prefix_the_filters_drop(vocab: int) -> None:
    """The filters drop a prefix of each sorted row: :func:`kept_start` is its length, and the draw
    from there gives the tokens of the draw over :func:`filter_sorted`'s masked values."""
    from megacp.generate import sampling

    ordered, top_k, floor = _filter_case(vocab, vocab)
    for k, f in ((top_k, floor), (top_k, None), (None, floor)):
        masked = filter_sorted(ordered, k, f)
        start = kept_start(ordered, k, f)
        dropped = masked.isinf()
        assert torch.equal(start, dropped.sum(-1)), (start.tolist(), dropped.sum(-1).tolist())
        assert torch.equal(dropped, torch.arange(vocab) < start[:, None])  # a prefix
        keys, columns = torch.arange(8) * 7919, sampling.mix32(torch.arange(vocab))
        for step in range(3):
            steps = torch.full((8,), step)
            assert torch.equal(sampling.gumbel_argmax(ordered, keys, steps, columns, start=start),
                               sampling.gumbel_argmax(masked, keys, steps, columns))
    assert kept_start(ordered, top_k, floor).tolist()[6] == vocab - 1  # top-k 1: the largest only


def test_fused_nucleus_start_equals_the_torch_count() -> None:
    """The Triton top-p start (two passes over the sorted row) equals the count of the columns the
    torch form drops, or differs only where the cumulative sum at the cut lies within 1e-5 of the
    floor (another summation order); the fused draw from a start equals the torch draw's."""
    from megacp.generate import sampling, sampling_kernel

    if sampling_kernel.triton is None:
        pytest.skip("Triton is missing")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        dev = CPU
    else:
        pytest.skip("the fused top-p cut runs on CUDA (or on the CPU under TRITON_INTERPRET=1)")
    for vocab in (1000, 49152, 128256):
        ordered, top_k, floor = _filter_case(vocab, 1)
        start_k = kept_start(ordered, top_k, None)
        want = kept_start(ordered, top_k, floor)  # the torch count on the CPU
        got = sampling_kernel.nucleus_start(ordered.to(dev), start_k.to(dev), floor.to(dev)).cpu()
        kept = ordered.masked_fill(torch.arange(vocab) < start_k[:, None], float("-inf"))
        cum = chunked_cumsum(kept.softmax(-1))
        for row in (got != want).nonzero().flatten().tolist():
            lo, hi = sorted((int(got[row]), int(want[row])))
            assert (cum[row, lo:hi + 1] - floor[row]).abs().max() < 1e-5, (vocab, row, lo, hi)
        assert (got == want).float().mean() >= 0.75, (vocab, got.tolist(), want.tolist())
        keys, steps, columns = torch.arange(8) * 31, torch.full((8,), 5), sampling.mix32(torch.arange(vocab))
        index = torch.arange(vocab).repeat(8, 1)
        fused = sampling_kernel.gumbel_argmax_fused(ordered.to(dev), keys.to(dev), steps.to(dev), index.to(dev), None,
                                                    None, None, want.to(dev)).cpu()
        assert torch.equal(fused, sampling.gumbel_argmax(ordered, keys, steps, columns, index=index, start=want))


def test_greedy_rows_of_a_filtered_batch_take_the_first_largest_logit() -> None:
    """Greedy rows beside top-p / top-k rows (row 2 greedy with a top-p of its own) are drawn from
    the sorted, filtered values without noise: their token is ``argmax``'s (the first of three tied
    largest logits), over several steps."""
    vocab = 3000
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(top_p=0.5), SamplingParams(temperature=1.2, top_k=20, seed=2)]
    g = torch.Generator().manual_seed(5)
    s = Sampler(params, vocab, CPU)
    for step in range(6):
        logits = torch.randn(len(params), vocab, generator=g)
        for row in (0, 2):  # three exact ties at the top
            top = logits[row].max() + 1
            logits[row, [2500 - 7 * step, 40 + step, 1200]] = top
        tokens = s(logits)
        assert tokens[0] == tokens[2] == 40 + step == int(logits[0].argmax()), (step, tokens)


def test_penalties_equal_transformers_token_for_token() -> None:
    """Greedy rows with penalties over 16 steps of random logits: the tokens equal transformers'
    repetition penalty on prompt + generated ids, then ``logit - f * count - p * (count > 0)``."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    vocab, steps = 40, 16
    params = [SamplingParams(repetition_penalty=1.4, presence_penalty=0.3, frequency_penalty=0.2),
              SamplingParams(repetition_penalty=0.7), SamplingParams(frequency_penalty=0.5),
              SamplingParams(presence_penalty=0.8), SamplingParams()]
    prompts = [[1, 5, 5, 9], [2, 3], [7], [4, 4, 8], [6]]
    g = torch.Generator().manual_seed(3)
    stream = torch.randn(steps, len(params), vocab, generator=g) * 0.5 + torch.linspace(1, 0, vocab)
    sampler = Sampler(params, vocab, CPU, prompts)
    ours = torch.stack([sampler(stream[t]) for t in range(steps)], dim=1).tolist()
    for row, (p, prompt) in enumerate(zip(params, prompts)):
        out: list[int] = []
        for t in range(steps):
            x = stream[t, row][None].clone()
            if p.repetition_penalty != 1.0:
                x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + out]), x)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab).float()
            x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            out.append(int(x.argmax()))
        assert ours[row] == out, (row, ours[row], out)
        plain = stream[:, row].argmax(-1).tolist()
        assert (ours[row] == plain) == (row == 4), row  # every penalty changes some token


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    vocab, steps = 64, 12
    a = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    others = [SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=1.5, top_k=5, min_p=0.1, seed=1),
              SamplingParams(temperature=1.0, frequency_penalty=0.5, seed=99)]
    g = torch.Generator().manual_seed(4)
    stream = torch.randn(steps, 4, vocab, generator=g)
    alone = Sampler([a], vocab, CPU, [[3]])
    batch = Sampler([others[0], a, *others[1:]], vocab, CPU, [[1], [3], [2], [5]])
    reseeded = Sampler([SamplingParams(temperature=0.8, top_p=0.9, seed=2)], vocab, CPU, [[3]])
    got = [(int(alone(stream[t, 1:2])[0]), int(batch(stream[t])[1]), int(reseeded(stream[t, 1:2])[0]))
           for t in range(steps)]
    assert [x for x, _, _ in got] == [y for _, y, _ in got]
    assert [x for x, _, _ in got] != [z for _, _, z in got]  # another seed, other tokens
    assert len({x for x, _, _ in got}) > 3  # it does sample


def test_unsorted_draws_equal_sorted_ones() -> None:
    """Rows without top-k / top-p draw without a sort (min-p as a floor, greedy rows noiseless):
    alone they give the tokens they give in a batch whose top-k row makes every row take the
    sorted path, and a greedy row gives the argmax."""
    vocab, steps = 300, 10
    rows = [SamplingParams(temperature=0.9, min_p=0.05, seed=3), SamplingParams(temperature=1.4, seed=4),
            SamplingParams()]
    g = torch.Generator().manual_seed(8)
    stream = torch.randn(steps, len(rows) + 1, vocab, generator=g) * 2
    alone = Sampler(rows, vocab, CPU)
    sorted_too = Sampler([*rows, SamplingParams(temperature=1.0, top_k=3, seed=5)], vocab, CPU)
    assert not any(alone.filters[:2]) and sorted_too.filters[0]
    for t in range(steps):
        a, b = alone(stream[t, :-1]), sorted_too(stream[t])
        assert torch.equal(a, b[:-1]), t
        assert int(a[2]) == int(stream[t, 2].argmax())


def test_noise_is_finite_at_the_largest_hash() -> None:
    """Key 0, step 611, vocabulary index 5056 hash to 2**24 - 1, where ``u`` rounds to 1 in fp32: the
    noise there is log(2**-24), and a draw whose floor removes that column does not pick it, sorted
    or not."""
    from megacp.generate import sampling

    key, step, col, vocab = 0, 611, 5056, 8192
    assert sampling.mix32(sampling.mix32((key + step * 0x9E3779B1) & 0xFFFFFFFF) ^ sampling.mix32(col)) >> 8 == 2**24 - 1
    keys, steps = torch.tensor([key]), torch.tensor([step])
    columns = sampling.mix32(torch.arange(vocab))
    noise = sampling.gumbel_noise(keys, steps, columns)
    assert noise.isfinite().all() and float(noise[0, col]) == pytest.approx(-16.6355323, abs=1e-6)
    values = torch.zeros(1, vocab)
    values[0, col] = -10.0
    floor = torch.tensor([-1.0])
    index = values.argsort(-1)
    assert int(sampling.gumbel_argmax(values, keys, steps, columns, floor=floor)) != col
    assert int(sampling.gumbel_argmax(values.gather(-1, index), keys, steps, columns, index=index, floor=floor)) != col


def test_fused_draw_equals_the_torch_form() -> None:
    """The Triton draw gives the tokens of the torch form written out here and of the module's torch
    fallback, with and without a sort index, temperature, min-p floor and noiseless rows, on
    vocabularies that do not fill its chunks, rows floored away entirely (their first column) and
    a column whose ``u`` rounds to 1 below the floor (key 0, step 611, vocabulary index 5056)."""
    from megacp.generate import sampling, sampling_kernel

    if sampling_kernel.triton is None:
        pytest.skip("Triton is missing")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
    elif os.environ.get("TRITON_INTERPRET") == "1":  # Triton's interpreter: about two minutes
        dev = CPU
    else:
        pytest.skip("the fused draw runs on CUDA (or on the CPU under TRITON_INTERPRET=1)")
    g = torch.Generator().manual_seed(9)
    for vocab in (1000, 49152, 50001):
        b = 64
        values = torch.randn(b, vocab, generator=g) * 3
        keys = torch.tensor([sampling.seed_key(i) for i in range(b)])
        steps = torch.randint(0, 1000, (b,), generator=g)
        steps[0] = 611
        if vocab > 5056:
            values[0, 5056] = values[0].amin()
        temperature = torch.rand(b, generator=g) + 0.5
        scaled_floor = values.amax(-1) / temperature - 2.0
        floor = values.amax(-1) - 2.0
        scaled_floor[1] = floor[1] = float("inf")
        noiseless = torch.arange(b) % 5 == 0
        index = values.argsort(-1)
        columns = sampling.mix32(torch.arange(vocab))
        for kw in (dict(), dict(temperature=temperature, floor=scaled_floor, noiseless=noiseless),
                   dict(index=index, floor=floor)):
            v = values.gather(-1, index) if "index" in kw else values
            fused = sampling_kernel.gumbel_argmax_fused(
                v.to(dev), keys.to(dev), steps.to(dev), *(t if t is None else t.to(dev) for t in (
                    kw.get("index"), kw.get("temperature"), kw.get("floor"), kw.get("noiseless")))).cpu()
            x = values / kw["temperature"][:, None] if "temperature" in kw else values
            x = x.masked_fill(x < kw["floor"][:, None], float("-inf")) if "floor" in kw else x
            noise = sampling.gumbel_noise(keys, steps, columns)
            noise = noise.masked_fill(kw["noiseless"][:, None], 0.0) if "noiseless" in kw else noise
            want = (x - noise).argmax(-1)
            if "index" in kw:  # a row floored away entirely gives its first (sorted) column
                want = torch.where((x == float("-inf")).all(-1), index[:, 0], want)
            assert torch.equal(fused, want), (vocab, list(kw), (fused != want).nonzero().flatten().tolist())
            assert torch.equal(fused, sampling.gumbel_argmax(v, keys, steps, columns, **kw)), (vocab, list(kw))


def test_draws_follow_the_softmax() -> None:
    """20000 seeds draw from one row of logits: the frequencies match the softmax at the temperature
    (within 0.012, ~3.5 standard deviations), and top-p 0.8 keeps only its nucleus (the two most likely)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 20000
    for top_p in (1.0, 0.8):
        params = [SamplingParams(temperature=0.7, top_p=top_p, seed=s) for s in range(n)]
        tokens = Sampler(params, 5, CPU)(logits.expand(n, 5))
        freq = torch.bincount(tokens, minlength=5).float() / n
        probs = torch.softmax(logits / 0.7, -1)
        if top_p < 1:
            probs = torch.where(torch.tensor([True, True, False, False, False]), probs, 0.0)
            probs = probs / probs.sum()
        assert (freq - probs).abs().max() < 0.012, (freq, probs)


def _byte_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld, naïve café ", "日本語のテキスト ", "stop here. END of line\n", "emoji 🙂🙃 done "] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def test_stop_strings_equal_the_full_decode_check() -> None:
    """Random token streams (byte-level pieces split characters) and encoded text, stop strings cut
    from their text: the first token at which the incremental check fires equals the first at
    which the whole decoded text contains a stop string."""
    from megacp.generate.outputs import StopStrings, decode

    tokenizer = _byte_bpe()
    vocab = len(tokenizer)
    g = torch.Generator().manual_seed(6)
    streams = [torch.randint(0, vocab, (50,), generator=g).tolist() for _ in range(6)]
    streams += [tokenizer("naïve café stop here. END 日本語 🙂 done")["input_ids"]]
    fired = 0
    for k, tokens in enumerate(streams):
        text = decode(tokenizer, tokens)
        for start, size in ((len(text) // 2, 1), (len(text) // 3, 3), (2 * len(text) // 3, 6), (0, len(text) + 1)):
            stop = [text[start: start + size] or "x", "zz"]
            if "\ufffd" in stop[0]:  # stop strings are text: no piece of a broken character
                continue
            check = StopStrings(tokenizer, stop)
            got = next((t for t in range(1, len(tokens) + 1) if check(tokens[:t])), None)
            ref = next((t for t in range(1, len(tokens) + 1)
                        if any(s in decode(tokenizer, tokens[:t]) for s in stop)), None)
            assert got == ref, (k, stop, got, ref)
            fired += ref is not None
    assert fired >= 10  # most cases compared fire


def test_text_stream_pieces_join_to_the_cut_text() -> None:
    """:class:`~megacp.generate.outputs.TextStream` fed each prefix of a token stream until it ends
    (its last token, or the first with a stop string): the pieces join to the whole text cut
    before its stop string, and no piece holds a broken character before the end."""
    from megacp.generate.outputs import StopStrings, TextStream, cut_at_stop, decode

    tokenizer = _byte_bpe()
    g = torch.Generator().manual_seed(8)
    streams = [tokenizer("naïve café stop here. END 日本語 🙂 done")["input_ids"]]
    streams += [torch.randint(0, len(tokenizer), (40,), generator=g).tolist() for _ in range(3)]
    for tokens in streams:
        text = decode(tokenizer, tokens)
        for stop in (["here."], ["🙂", "END"], [text[len(text) // 2: len(text) // 2 + 2]], ["zz"]):
            stream, check = TextStream(tokenizer, stop), StopStrings(tokenizer, stop)
            pieces = []
            for t in range(1, len(tokens) + 1):
                end = check(tokens[:t]) or t == len(tokens)
                pieces.append(stream.piece(tokens[:t], end))
                if end:
                    break
            assert "".join(pieces) == cut_at_stop(decode(tokenizer, tokens[:t]), stop)[0], (stop, pieces)
            assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in text, pieces


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_logprobs_refused_in_one_line(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^logprobs must be None or an integer >= 0"):
        SamplingParams(logprobs=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logprobs=9 exceeds the vocabulary of 8 tokens"):
        Sampler([SamplingParams(logprobs=9)], 8, torch.device("cpu"))


def test_logprobs_are_the_raw_log_softmax_of_each_row() -> None:
    """Greedy with a repetition penalty and sampled rows: the chosen token's and the top tokens'
    log-probabilities are ``torch.log_softmax`` of the logits given (fp64 reference), not of the
    penalised or tempered ones; rows that ask for fewer top tokens get fewer; 0 gives the chosen only."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 50, generator=g) * 3
    params = [SamplingParams(logprobs=4, repetition_penalty=2.0), SamplingParams(temperature=0.5, seed=2, logprobs=0),
              SamplingParams(temperature=1.3, top_k=5, seed=9, logprobs=2)]
    sampler = Sampler(params, 50, torch.device("cpu"), context=[[int(logits[0].argmax())], [], []])
    tokens = sampler(logits).tolist()
    assert sampler.logprobs is not None
    rows = logprob_dicts(tokens, *(t.tolist() for t in sampler.logprobs), [p.logprobs for p in params])
    ref = logits.double().log_softmax(-1)
    assert tokens[0] != int(logits[0].argmax())  # the penalty moved the greedy choice
    for b, (row, k) in enumerate(zip(rows, (4, 0, 2))):
        assert row is not None and list(row)[0] == tokens[b]
        assert set(row) == {tokens[b], *ref[b].topk(k).indices.tolist()}
        for t, v in row.items():
            assert abs(v - float(ref[b, t])) < 1e-5
    assert logprob_dicts([1], [-0.5], [[1, 2]], [[-0.5, -1.0]], [None]) == [None]
    assert logprob_dicts([2], [-1.0], [[1, 2]], [[-0.5, -1.0]], [2]) == [{2: -1.0, 1: -0.5}]


def test_unseeded_requests_get_fresh_seeds_and_seeded_ones_keep_theirs() -> None:
    """``seed=None`` (the default, as vLLM's and OpenAI's) draws a fresh seed per request and per run;
    a given seed is kept; the server's unseeded requests get fresh seeds too."""
    from megacp.generate.sampling import SamplingParams, SeedSource
    from megacp.serve.protocol import CompletionRequest

    assert SamplingParams().seed is None
    one, two = SeedSource(torch.device("cpu")), SeedSource(torch.device("cpu"))
    p = SamplingParams(temperature=0.8)
    seeds = [one.resolve(p).seed for _ in range(3)] + [two.resolve(p).seed]
    assert all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 4
    assert one.resolve(SamplingParams(temperature=0.8, seed=7)).seed == 7
    body = {"model": "m", "prompt": "hi", "temperature": 0.8}
    drawn = {CompletionRequest(**body).sampling(None, 4, 64).seed for _ in range(3)}
    assert len(drawn) == 3 and CompletionRequest(**body, seed=5).sampling(None, 4, 64).seed == 5


def test_the_generate_cli_samples_with_a_fresh_seed_unless_given() -> None:
    """``python -m megacp.generate --temperature 0.8`` hands ``LLM`` an unseeded request (which
    :class:`~megacp.generate.sampling.SeedSource` gives a fresh seed), ``--seed N`` a seeded one."""
    from megacp.generate.cli import parse_args, validate

    assert validate(parse_args(["--prompt", "hi", "--temperature", "0.8"]))[0].seed is None
    assert validate(parse_args(["--prompt", "hi", "--temperature", "0.8", "--seed", "3"]))[0].seed == 3
