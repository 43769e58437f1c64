"""Sampling the next token of a batch of requests with settings of their own: greedy, or
temperature with top-k / top-p / min-p filtering, after repetition / presence / frequency penalties,
with the log-probabilities of the draw on request.

A :class:`Sampler` holds one row per request: its settings as device tensors, its seed, the index of
the token it draws next, and (with penalties) the prompt tokens and counts of generated tokens
``[B, V]``. :meth:`Sampler.__call__` turns fp32 logits ``[B, V]`` into tokens ``[B]`` with tensor
ops of static shapes only (no host synchronisation), so the same function runs in the eager loop
and inside the captured decode graph. Filters follow Hugging Face's warpers in their order
(temperature, top-k, top-p, min-p); the draw is Gumbel-max with noise hashed from (seed, token
index, vocabulary index) in integer ops: a request's tokens depend on its logits and seed only, not
on the batch around it, the CP size or the path (eager or graph). Temperatures below
:data:`GREEDY_BELOW` are greedy (argmax).

A draw costs what its batch needs: an all-greedy batch is one argmax; without top-k and top-p no
sort runs (min-p is a floor on the scaled logits, :func:`min_p_floor`) and the temperature, the
floor, the noise and the argmax are one pass (:func:`gumbel_argmax`; on CUDA a fused kernel,
:mod:`megacp.generate.sampling_kernel`); with top-k or top-p, one sort of the scaled logits, each
row's first kept sorted column (:func:`kept_start`: the filters drop a prefix of the sorted row)
and the same pass over the sorted values from there.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence, TypeVar

import torch
from torch import Tensor

from megacp.generate import sampling_kernel


class Filters(NamedTuple):
    """Which filters a :class:`Sampler`'s draw runs (those any sampled row of its batch asks for)."""

    top_k: bool
    top_p: bool
    min_p: bool


class Features(NamedTuple):
    """Which steps a :class:`Sampler`'s draw runs (:attr:`Sampler.features`; with the batch size,
    the key of a captured decode graph)."""

    sampled: bool
    """Some row samples (else every row is greedy: one argmax)."""
    filters: Filters
    penalised: bool
    """Some row has a repetition, presence or frequency penalty (the counts of generated tokens)."""
    repeats: bool
    """Some row has a repetition penalty (the context tokens it also penalises)."""

    @classmethod
    def union(cls, rows: Iterable[Features]) -> Features:
        """The steps a batch of requests drawing with ``rows`` runs: each one any of them runs."""
        every = list(rows)
        filters = [f.filters for f in every]
        return cls(any(f.sampled for f in every),
                   Filters(any(x.top_k for x in filters), any(x.top_p for x in filters), any(x.min_p for x in filters)),
                   any(f.penalised for f in every), any(f.repeats for f in every))


GREEDY = Features(False, Filters(False, False, False), False, False)
"""The features of an all-greedy batch without penalties (one argmax)."""

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (argmax); 0 is the documented way to ask for it."""

DEFAULT_MAX_TOKENS = 16

MAX_LOGPROBS = 20
"""The most top log-probabilities per generated token a request may ask for (vLLM's default
``max_logprobs``, OpenAI's chat ``top_logprobs`` limit)."""

SEED_RANGE = (-(2**63), 2**64)
"""The seeds a request may give, ``[low, high)``: ``torch.manual_seed``'s range (a seed's low 64
bits make its key, :func:`seed_key`, so a larger one would alias a smaller one)."""


@dataclass
class SamplingParams:
    """How to generate (the names follow vLLM's ``SamplingParams``).

    Attributes:
        max_tokens: tokens to generate at most (``max_new_tokens`` is an alias; give one of them).
        temperature: 0 (or below :data:`GREEDY_BELOW`) = greedy.
        top_p: nucleus sampling, in (0, 1].
        top_k: keep the ``top_k`` most likely tokens (0 = all).
        min_p: drop tokens less likely than ``min_p`` times the most likely one, in [0, 1] (0 = off).
        seed: seed of the request's draws, in :data:`SEED_RANGE` (its tokens depend on its seed and
            logits only: the same alone or in any batch, on every rank and CP size); ``None`` (default): a fresh seed per
            request, as vLLM's and OpenAI's unseeded requests (:class:`SeedSource`).
        stop: strings that end a request (found in the decoded text; the text ends before it).
        stop_token_ids: token ids that end a request (kept in ``token_ids``).
        ignore_eos: do not add the model's end-of-sequence tokens to ``stop_token_ids``.
        repetition_penalty: Hugging Face's rule: a token already in the prompt or output has its
            logit divided by it when positive, multiplied when negative (1 = off).
        presence_penalty: subtracted from the logit of every token generated so far (0 = off).
        frequency_penalty: subtracted once per time a token was generated so far (0 = off).
        logprobs: per generated token, return the natural-log probability of the chosen token and
            of the ``logprobs`` most likely tokens (``None`` = none; 0 = the chosen token's only; at
            most :data:`MAX_LOGPROBS`):
            the log-softmax of the model's fp32 logits, before penalties, temperature and filters
            (vLLM's default ``raw_logprobs``).

    Raises:
        ValueError: one value out of range (NaN included), naming it.
    """

    max_tokens: int = None  # type: ignore[assignment]  # None until __post_init__: max_new_tokens or the default
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    max_new_tokens: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_new_tokens is not None and self.max_tokens != self.max_new_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and its alias max_new_tokens={self.max_new_tokens} differ")
        n = next((v for v in (self.max_tokens, self.max_new_tokens) if v is not None), DEFAULT_MAX_TOKENS)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {n!r}")
        self.max_tokens = self.max_new_tokens = n
        _check_float("temperature", self.temperature, lambda x: x >= 0, ">= 0 (0 = greedy)")
        _check_float("temperature", self.temperature, math.isfinite, "a finite number (0 = greedy)")
        _check_float("top_p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1]")
        _check_float("repetition_penalty", self.repetition_penalty, lambda x: x > 0, "> 0 (1 = off)")
        _check_float("min_p", self.min_p, lambda x: 0 <= x <= 1, "in [0, 1] (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), math.isfinite, "a finite number (0 = off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = all tokens), got {self.top_k!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer >= 0 and <= {MAX_LOGPROBS} (top tokens per "
                             f"generated token; vLLM's max_logprobs), got {self.logprobs!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**64) (torch.manual_seed's range), got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {list(self.stop)!r}")
        self.stop = tuple(self.stop)
        if not all(type(t) is int and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers >= 0, got {list(self.stop_token_ids)!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):  # a string such as 'no' would read as true
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax."""
        return self.temperature < GREEDY_BELOW

    def finish_reason(self, tokens: list[int], stop_check: Callable[[list[int]], bool] | None = None) -> str | None:
        """Why a request with these settings ends after generating ``tokens`` (non-empty): ``"stop"``
        (the last token is a stop token, or ``stop_check(tokens)``: they end in a stop string),
        ``"length"`` (``max_tokens`` reached), or ``None`` (it goes on). The one rule of
        ``LLM.generate``, sessions and the server."""
        if tokens[-1] in self.stop_token_ids or (stop_check is not None and stop_check(tokens)):
            return "stop"
        return "length" if len(tokens) >= self.max_tokens else None

    @property
    def penalised(self) -> bool:
        """Whether a repetition, presence or frequency penalty is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def batch_params(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per request of a batch of ``n``: ``params`` for all, or a list of ``n``.

    Raises:
        ValueError: a list of another length, or anything but :class:`SamplingParams` (a dict, say).
    """
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (dict, str)) or not hasattr(params, "__iter__"):
        raise ValueError(f"sampling must be a SamplingParams or a list of them, got a {type(params).__name__}"
                         + (": pass SamplingParams(**that_dict)" if isinstance(params, dict) else ""))
    rows = list(params)
    bad = next((type(r).__name__ for r in rows if not isinstance(r, SamplingParams)), None)
    if bad is not None:
        raise ValueError(f"sampling must be a SamplingParams or a list of them, got a list holding a {bad}")
    if len(rows) != n:
        raise ValueError(f"{len(rows)} SamplingParams for {n} prompts; give one for all or one per prompt")
    return rows


def _check_float(name: str, value: object, ok, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}")


_MASK32 = 0xFFFFFFFF
_WEYL = 0x9E3779B1  # 2**32 / golden ratio: successive token indices land far apart before the hash
_Int = TypeVar("_Int", int, Tensor)


def mix32(x: _Int) -> _Int:
    """A 32-bit integer hash of ``x`` in [0, 2**32) (an int, or an int64 tensor elementwise): two
    xor-shift-multiply rounds whose odd multiplier is below 2**31, so no int64 product overflows."""
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


class SeedSource:
    """Seeds for requests that give none (``seed=None``): fresh for every request and every run, yet
    the same on every rank of a job, so that the ranks draw the same tokens and agree on the settings.

    Rank 0 draws a random 63-bit base from the OS and broadcasts it over the default process group
    (collective: every rank builds its source at the same point); each rank then takes the same
    sequence of seeds from a generator of that base, one per unseeded request in the order the
    requests come (every rank sees the same requests in the same order).

    Args:
        device: where the broadcast's tensor lives (the backend's device: CUDA for NCCL).
    """

    def __init__(self, device: torch.device) -> None:
        import secrets

        import torch.distributed as dist

        base = torch.tensor([secrets.randbits(63)], dtype=torch.long, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(base, src=0)
        self._draws = random.Random(int(base))

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """``params`` with a fresh seed when it has none."""
        if params.seed is not None:
            return params
        return dataclasses.replace(params, seed=self._draws.getrandbits(63))


def seed_key(seed: int) -> int:
    """The 32-bit key of a request's ``seed`` (any Python int; its low 64 bits count)."""
    seed &= (1 << 64) - 1
    return mix32(mix32(seed & _MASK32) ^ (seed >> 32))


def gumbel_noise(keys: Tensor, steps: Tensor, columns: Tensor) -> Tensor:
    """``log(-log(u))`` fp32 ``[B, N]`` (a negated Gumbel(0, 1) draw) of uniform ``u`` in (0, 1)
    hashed from (``keys[b]``, ``steps[b]``, vocabulary index) per element (``keys``, ``steps`` ``[B]``
    int64, ``steps`` < 2**31; ``columns`` int64 ``[N]`` or ``[B, N]``: :func:`mix32` of the
    vocabulary indices; 24 bits of ``u``). ``argmax(logits - noise)`` draws from ``softmax(logits)``.
    The largest hash rounds ``u`` to 1 in fp32; ``-log(u)`` is held at 2**-24 or above (its value at
    ``u = 1 - 2**-24``), so the noise is finite: no column wins whatever its logit, and no ``-inf``
    (filtered) column turns NaN and wins the argmax."""
    row = mix32((keys + steps * _WEYL) & _MASK32)
    bits = mix32(row[:, None] ^ (columns if columns.dim() == 2 else columns[None, :])) >> 8
    return torch.log((-torch.log((bits.float() + 0.5) * 2.0 ** -24)).clamp_min(2.0 ** -24))


def gumbel_argmax(values: Tensor, keys: Tensor, steps: Tensor, columns: Tensor, *, index: Tensor | None = None,
                  temperature: Tensor | None = None, floor: Tensor | None = None,
                  noiseless: Tensor | None = None, start: Tensor | None = None) -> Tensor:
    """Each row's draw ``[B]`` int64: the vocabulary index of ``argmax(x - noise)`` over the row's
    columns, ``x = values / temperature`` (``values [B, N]`` fp32; ``temperature [B]`` fp32,
    ``None`` = 1) set to ``-inf`` below ``floor [B]`` fp32, ``noise`` :func:`gumbel_noise` of the
    row's key and step at column ``n``'s vocabulary index: ``index[b, n]`` (``[B, N]`` int64), or
    ``n`` (``columns [V]`` int64 = :func:`mix32` of the vocabulary indices). Rows whose
    ``noiseless [B]`` bool is true take the argmax of ``x``. Columns before ``start [B]`` int64
    (the sorted columns the top-k / top-p filters drop, :func:`kept_start`) are ``-inf``. Ties go
    to the first column. On CUDA with Triton: one fused pass (:mod:`megacp.generate.sampling_kernel`)."""
    if sampling_kernel.available(values):
        return sampling_kernel.gumbel_argmax_fused(values, keys, steps, index, temperature, floor, noiseless, start)
    x = values if temperature is None else values / temperature[:, None]
    if floor is not None:
        x = x.masked_fill(x < floor[:, None], float("-inf"))
    if start is not None:
        x = x.masked_fill(torch.arange(x.shape[-1], device=x.device) < start[:, None], float("-inf"))
    noise = gumbel_noise(keys, steps, columns if index is None else columns[index])
    if noiseless is not None:
        noise = noise.masked_fill(noiseless[:, None], 0.0)
    pick = (x - noise).argmax(dim=-1)
    return pick if index is None else index.gather(-1, pick[:, None]).squeeze(-1)


def penalise(logits: Tensor, prompt_seen: Tensor | None, counts: Tensor, repetition: Tensor, presence: Tensor,
             frequency: Tensor) -> Tensor:
    """``logits [B, V]`` fp32 after the penalties of each row (``repetition``, ``presence``,
    ``frequency`` ``[B]`` fp32). ``counts [B, V]`` int32: times each token was generated so far;
    ``prompt_seen [B, V]`` bool: the tokens of each request's context. The repetition penalty
    (Hugging Face's rule) acts on prompt and generated tokens, presence and frequency penalties
    (OpenAI's rule: ``logit - frequency * count - presence * (count > 0)``) on generated ones."""
    generated = counts > 0
    seen = generated if prompt_seen is None else generated | prompt_seen
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits < 0, logits * rep, logits / rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * generated


def kept_start(ordered: Tensor, top_k: Tensor | None, top_p_floor: Tensor | None) -> Tensor:
    """The first column ``[B]`` int64 of ``ordered`` (temperature-scaled logits sorted ascending
    ``[B, V]`` fp32) that top-k and top-p keep, as Hugging Face's ``TopKLogitsWarper`` and
    ``TopPLogitsWarper`` in turn: both drop a prefix of each sorted row (top-k the values below the
    k-th largest; top-p the columns whose cumulative probability is at most ``1 - top_p``, never the
    last; ``top_k [B]`` int64 in [1, V], ``top_p_floor [B]`` fp32 = ``1 - top_p``, ``None`` skips a
    filter). Top-k's start is a binary search for the k-th largest value;
    top-p's, on CUDA with Triton, two passes over ``ordered``
    (:func:`~megacp.generate.sampling_kernel.nucleus_start`), else the count of the columns whose
    cumulative probability is at or below the floor. The draw then starts there (:func:`gumbel_argmax`'s ``start``)."""
    start = None
    if top_k is not None:
        kth = ordered.gather(-1, (ordered.shape[-1] - top_k)[:, None])
        start = torch.searchsorted(ordered, kth).squeeze(-1)  # the columns below the k-th largest value
    if top_p_floor is None:
        assert start is not None, "kept_start needs top-k or top-p"
        return start
    if sampling_kernel.available(ordered):
        return sampling_kernel.nucleus_start(ordered, start, top_p_floor)
    kept = ordered if start is None else ordered.masked_fill(
        torch.arange(ordered.shape[-1], device=ordered.device) < start[:, None], float("-inf"))
    drop = chunked_cumsum(kept.softmax(-1)) <= top_p_floor[:, None]
    return drop.sum(-1).clamp_(max=ordered.shape[-1] - 1)


def chunked_cumsum(x: Tensor, chunk: int = 1024) -> Tensor:
    """``x.cumsum(-1)`` of ``x [B, V]`` in two levels: the sums within chunks of ``chunk`` columns
    (``B x V / chunk`` rows, all at once), then each chunk's offset, the sum of the chunks before
    it. A GPU scan of a few long rows runs a few thread blocks; the chunked one fills the GPU."""
    rows, n = x.shape
    chunks = -(-n // chunk)
    within = torch.nn.functional.pad(x, (0, chunks * chunk - n)).view(rows, chunks, chunk).cumsum(-1)
    totals = within[..., -1]
    return (within + (totals.cumsum(-1) - totals)[..., None]).view(rows, chunks * chunk)[:, :n]


def min_p_floor(top: Tensor, log_min_p: Tensor) -> Tensor:
    """The temperature-scaled logit ``[B]`` fp32 below which min-p drops a token: ``top [B]``, the
    row's largest scaled logit, plus ``log_min_p [B]`` (``log(min_p)``; ``-inf`` = off). A token
    less likely than ``min_p`` times the most likely one has ``p / p_max = exp(x - top) < min_p``:
    Hugging Face's ``MinPLogitsWarper`` in log space, unchanged by top-k and top-p before it (they
    keep the most likely token and do not change probability ratios)."""
    return top + log_min_p


class Sampler:
    """The sampling state of a batch of ``len(params)`` requests (row ``i``: ``params[i]``).

    Args:
        params: each request's settings.
        vocab: the vocabulary size V.
        device: where the state lives.
        context: each request's tokens so far (its prompt; a session's whole conversation) for the
            repetition penalty; needed when a row has one.

    The tensors (``[B]`` unless said): ``temperature`` fp32 (1 on greedy rows), ``top_k`` int64
    (V = off), ``top_p_floor`` fp32 (``1 - top_p``), ``log_min_p`` (``log(min_p)``), ``repetition``, ``presence``,
    ``frequency`` fp32, ``keys`` int64 (:func:`seed_key`), ``steps`` int64 (index of the token
    each row draws next), ``columns [V]`` int64 (vocabulary hashes, when a row samples), ``counts [B, V]`` int32 (generated tokens; with penalties) and
    ``prompt_seen [B, V]`` bool (with a repetition penalty). Which steps run is fixed by the batch
    (:attr:`features`): an all-greedy batch without penalties is one argmax.

    With a row that asks for ``logprobs``, each call also leaves :attr:`logprobs` on the device:
    the chosen tokens' log-probabilities ``[B]`` fp32 and the ``top_logprobs`` (the largest
    ``logprobs`` of the batch) most likely tokens ``[B, K]`` int64 with theirs ``[B, K]`` fp32,
    from the log-softmax of the logits as given (:func:`logprob_dicts` reads them on the host).

    Raises:
        ValueError: a row asks for more ``logprobs`` than the vocabulary holds, or a repetition
            penalty comes without ``context``.
    """

    def __init__(self, params: Sequence[SamplingParams], vocab: int, device: torch.device,
                 context: Sequence[Sequence[int]] | None = None) -> None:
        self.vocab, self.device = vocab, device
        self.sampled = any(not p.greedy for p in params)
        drawn = [p for p in params if not p.greedy]
        self.filters = Filters(any(p.top_k > 0 for p in drawn), any(p.top_p < 1.0 for p in drawn),
                               any(p.min_p > 0 for p in drawn))
        self.penalised = any(p.penalised for p in params)
        repeats = any(p.repetition_penalty != 1.0 for p in params)
        self.top_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if self.top_logprobs is not None and self.top_logprobs > vocab:
            raise ValueError(f"logprobs={self.top_logprobs} exceeds the vocabulary of {vocab} tokens")
        self.logprobs: tuple[Tensor, Tensor, Tensor] | None = None
        """After a call with :attr:`top_logprobs` set: (chosen ``[B]`` fp32, top ids ``[B, K]``
        int64, top log-probabilities ``[B, K]`` fp32) of that call's draw."""

        def col(values: Sequence[float | int], dtype: torch.dtype) -> Tensor:
            return torch.tensor(list(values), dtype=dtype, device=device)

        self.greedy = col([p.greedy for p in params], torch.bool)
        self.temperature = col([1.0 if p.greedy else p.temperature for p in params], torch.float32)
        self.top_k = col([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long)
        self.top_p_floor = col([1.0 - p.top_p for p in params], torch.float32)
        self.log_min_p = col([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], torch.float32)
        self.repetition = col([p.repetition_penalty for p in params], torch.float32)
        self.presence = col([p.presence_penalty for p in params], torch.float32)
        self.frequency = col([p.frequency_penalty for p in params], torch.float32)
        # the entry points (LLM, sessions, the server) give unseeded requests fresh seeds first
        # (SeedSource); a Sampler built directly draws an unseeded row as seed 0
        self.keys = col([seed_key(p.seed or 0) for p in params], torch.long)
        self.steps = torch.zeros(len(params), dtype=torch.long, device=device)
        self.columns = mix32(torch.arange(vocab if self.sampled else 0, dtype=torch.long, device=device))
        shape = (len(params), vocab) if self.penalised else (len(params), 0)
        self.counts = torch.zeros(shape, dtype=torch.int32, device=device)
        self.ones = torch.ones(len(params), 1, dtype=torch.int32, device=device)
        self.prompt_seen: Tensor | None = None
        if repeats:
            if context is None:
                raise ValueError("a repetition penalty needs each request's context tokens")
            seen = torch.zeros(len(params), vocab, dtype=torch.bool)
            for row, ctx in enumerate(context):
                seen[row, torch.tensor(list(ctx), dtype=torch.long)] = True
            self.prompt_seen = seen.to(device)

    @property
    def features(self) -> Features:
        """Which steps a draw runs (a captured graph's key with the batch size): sampling, the
        (top-k, top-p, min-p) filters, penalties, the repetition penalty's context tokens."""
        return Features(self.sampled, self.filters, self.penalised, self.prompt_seen is not None)

    @classmethod
    def buffers(cls, rows: int, vocab: int, device: torch.device) -> Sampler:
        """``rows`` rows holding the tensors of every step (a static batch's buffers: :meth:`view`
        picks the steps a draw runs, :meth:`put_rows` fills rows; their values until then are
        placeholders)."""
        every = SamplingParams(temperature=1.0, top_k=1, top_p=0.5, min_p=0.5, repetition_penalty=2.0)
        return cls([every] * rows, vocab, device, context=[[0]] * rows)

    def view(self, rows: int, features: Features) -> Sampler:
        """The first ``rows`` rows (views of this sampler's tensors) drawing with the steps of
        ``features`` only (this sampler must hold their tensors: :meth:`buffers`)."""
        if ((features.sampled and self.columns.numel() != self.vocab)
                or (features.penalised and self.counts.shape[1] != self.vocab)
                or (features.repeats and self.prompt_seen is None)):
            raise ValueError(f"a sampler of features {self.features} has no tensors for the steps of {features}")
        out = self._map(lambda t: t[:rows])
        out.sampled, out.filters, out.penalised = features.sampled, features.filters, features.penalised
        if not features.repeats:
            out.prompt_seen = None
        return out

    def put_rows(self, rows: Tensor, src: Sampler, src_rows: Tensor) -> None:
        """Copy rows ``src_rows`` of ``src`` into rows ``rows`` of this sampler (int64 indices
        ``[n]`` on its device; ``src`` may be this sampler). A tensor ``src`` does not hold (counts
        without penalties, context tokens without a repetition penalty) is zeroed in those rows."""
        if src.vocab != self.vocab:
            raise ValueError(f"a sampler of vocabulary {src.vocab} cannot fill rows of one of {self.vocab}")
        for name in self._ROWS:
            dst, val = getattr(self, name), getattr(src, name)
            if dst is None:
                continue
            if val is None or val.shape[1:] != dst.shape[1:]:
                dst.index_fill_(0, rows, 0)
            else:
                dst.index_copy_(0, rows, val.index_select(0, src_rows))

    _ROWS = ("greedy", "temperature", "top_k", "top_p_floor", "log_min_p", "repetition", "presence", "frequency", "keys",
             "steps", "counts", "ones", "prompt_seen")
    """The tensors with one row per request (``columns`` is shared by every row)."""

    def state(self) -> list[Tensor]:
        """The tensors a draw advances (to save and restore around a warm-up)."""
        return [self.steps, self.counts]

    def _map(self, fn: Callable[[Tensor], Tensor]) -> Sampler:
        out = Sampler.__new__(Sampler)
        out.__dict__.update(vars(self))
        for name in self._ROWS:
            if getattr(self, name) is not None:
                setattr(out, name, fn(getattr(self, name)))
        return out

    def __call__(self, logits: Tensor) -> Tensor:
        """Next tokens ``[B]`` int64 of ``logits [B, V]`` (identical on every rank given identical
        logits); the counts and token indices advance by the drawn tokens, and :attr:`logprobs`
        holds the draw's log-probabilities when a row asks for them."""
        logits = logits.float()
        raw = logits
        if self.penalised:
            logits = penalise(logits, self.prompt_seen, self.counts, self.repetition, self.presence, self.frequency)
        if not self.sampled:
            tokens = logits.argmax(dim=-1)
        else:
            top_k, top_p = self.filters.top_k, self.filters.top_p
            floor = min_p_floor(logits.amax(dim=-1) / self.temperature, self.log_min_p) if self.filters.min_p else None
            if top_k or top_p:
                # ascending, as the warpers sort; stable: a greedy row's first largest column is its argmax
                ordered, index = (logits / self.temperature[:, None]).sort(dim=-1, stable=True)
                # the filters drop a prefix of each sorted row: the draw starts after it
                start = kept_start(ordered, self.top_k if top_k else None, self.top_p_floor if top_p else None)
                # the filters keep every row's most likely token: greedy rows take it without noise
                tokens = gumbel_argmax(ordered, self.keys, self.steps, self.columns, index=index, floor=floor,
                                       noiseless=self.greedy, start=start)
            else:  # greedy rows draw without noise at temperature 1: their argmax
                tokens = gumbel_argmax(logits, self.keys, self.steps, self.columns, temperature=self.temperature,
                                       floor=floor, noiseless=self.greedy)
        if self.penalised:
            self.counts.scatter_add_(1, tokens[:, None], self.ones)
        if self.top_logprobs is not None:
            self.logprobs = draw_logprobs(raw, tokens, self.top_logprobs)
        self.steps.add_(1)
        return tokens


def draw_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The log-probabilities of a draw of ``tokens [B]`` int64 from fp32 ``logits [B, V]`` (their
    log-softmax): the chosen tokens' ``[B]`` fp32, and the ``k`` most likely tokens ``[B, k]`` int64
    with theirs ``[B, k]`` fp32, most likely first (:attr:`Sampler.logprobs`' layout)."""
    lp = logits.log_softmax(dim=-1)
    top = lp.topk(k, dim=-1)
    return lp.gather(-1, tokens[:, None]).squeeze(-1), top.indices, top.values


def logprob_dicts(tokens: Sequence[int], chosen: Sequence[float], top_ids: Sequence[Sequence[int]],
                  top_values: Sequence[Sequence[float]], counts: Sequence[int | None]) -> list[dict[int, float] | None]:
    """Host form of one draw's :attr:`Sampler.logprobs` (read as lists), row by row: ``None`` where
    ``counts[b]`` is ``None``, else ``{token: logprob}`` of the chosen ``tokens[b]`` first, then its
    ``counts[b]`` most likely tokens, most likely first (vLLM's layout; a chosen token among the
    top ones appears once, at the front)."""
    out: list[dict[int, float] | None] = []
    for b, k in enumerate(counts):
        if k is None:
            out.append(None)
            continue
        row = {tokens[b]: chosen[b]}
        for t, v in zip(top_ids[b][:k], top_values[b][:k]):
            row.setdefault(t, v)
        out.append(row)
    return out


def sample(logits: Tensor, params: SamplingParams | Sequence[SamplingParams],
           context: Sequence[Sequence[int]] | None = None) -> Tensor:
    """The first tokens ``[B]`` int64 that requests with ``params`` (one for all rows, or one per
    row) and ``context`` (for the repetition penalty) draw from ``logits [B, V]``."""
    rows = [params] * logits.shape[0] if isinstance(params, SamplingParams) else list(params)
    return Sampler(rows, logits.shape[-1], logits.device, context)(logits)
