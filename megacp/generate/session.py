"""A conversation on the persistent CP-sharded KV cache: each turn prefills only its new tokens on
top of everything cached (a ring prefill whose strategy follows the usual rule: under ``auto`` a
short turn over a long cache goes pass-Q), then decodes; prompt and generated tokens stay cached.

Each turn is one request of the sessions' engine (:class:`~megacp.generate.engine.EngineCore`)
pinned to the session's slot, on top of what the slot holds. A generated token not yet through the
model (the last one of a turn) is prefilled with the next turn. Several sessions share one cache
and engine, one request slot each.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Sequence

from megacp.generate.engine import EngineCore, Request, result_of, token_events
from megacp.generate.outputs import GenerationOutput, chat_ids, outputs_of, with_eos
from megacp.generate.requests import ModelLimits, check_context, check_prompt, encode
from megacp.generate.sampling import SamplingParams, SeedSource
from megacp.kv_cache import CacheCapacityError


class Session:
    """One conversation's slot of a shared cache (make it with :meth:`megacp.LLM.session`).

    Every CP rank must call the same methods with the same arguments. Use it as a context manager
    or call :meth:`close` to give its slot back (``release`` is then called). Each method runs under
    ``hold(call, arguments)``: its ``LLM`` held for the call (calls from several threads run one at a
    time), and under CP the ranks' agreement on the call when ``arguments`` is not ``None``.
    """

    def __init__(self, engine: EngineCore, slot: int, model_config: ModelLimits, tokenizer: Any, max_tokens: int,
                 seeds: SeedSource, release: Callable[[], None],
                 hold: Callable[[str, Any], AbstractContextManager[None]]) -> None:
        self._engine, self._slot, self._cfg, self._tokenizer = engine, slot, model_config, tokenizer
        self._seeds, self._release, self._hold = seeds, release, hold
        self.max_tokens = max_tokens
        """Tokens the session may hold in all (``LLM(max_session_tokens=...)``)."""
        self._history: list[int] = []
        self.closed = False
        self.last_report: dict[str, Any] = {}
        """The report of the latest turn (its prefill strategies, TTFT, decode rate)."""

    @property
    def history(self) -> list[int]:
        """Every token of the conversation so far: turns and generated tokens, in order."""
        return list(self._history)

    def send(self, turn: str | Sequence[int], sampling: SamplingParams | None = None,
             on_token: Callable[[int, int], None] | None = None) -> GenerationOutput:
        """Add ``turn`` (text, or token ids) to the conversation and generate the reply. Text is
        tokenized with the tokenizer's special tokens (e.g. BOS) only as the first turn.

        Raises:
            ValueError: the session is closed, the turn is empty, out of the vocabulary, not valid
                UTF-8, or the conversation would outgrow the model's context.
            CacheCapacityError: it would hold more than :attr:`max_tokens` tokens, or outgrow its
                cache slot on some CP rank.
            Both before any work. Any error part-way (an ``on_token`` callback raising,
            ``KeyboardInterrupt``) leaves the session and its cache slot as before the turn.
        """
        with self._hold(f"session {self._slot} send", (turn, sampling)):
            return self._send(turn, sampling, on_token)

    def _send(self, turn: str | Sequence[int], sampling: SamplingParams | None,
              on_token: Callable[[int, int], None] | None) -> GenerationOutput:
        """:meth:`send` on the held ``LLM``."""
        if self.closed:
            raise ValueError("this session is closed")
        params = with_eos(self._seeds.resolve(sampling or SamplingParams()), self._cfg.eos_token_ids)
        turn = encode(self._tokenizer, turn, "turn", special_tokens=not self._history)
        check_prompt(self._cfg, turn, params.max_tokens, "turn")
        check_context(self._cfg, len(self._history) + len(turn), params.max_tokens, "the conversation")
        total = len(self._history) + len(turn) + params.max_tokens
        if total > self.max_tokens:
            raise CacheCapacityError(f"the session would hold {len(self._history)} + {len(turn)} (turn) + "
                                     f"{params.max_tokens} (max_tokens) = {total} tokens, more than its "
                                     f"{self.max_tokens} (LLM(max_session_tokens=...))")
        pending = self._history[self._engine.held(self._slot):] + turn
        self._engine.check_room(self._slot, len(pending), params.max_tokens)
        before = self._engine.snapshot(self._slot)
        req = Request(pending, params, context=self._history + turn, pin=self._slot)
        try:
            self.last_report = self._engine.run([req], token_events(on_token))
        except BaseException:  # an on_token callback raising, KeyboardInterrupt: the turn never happened
            self._engine.restore(self._slot, before)
            raise
        out = outputs_of(result_of([req], self.last_report), [pending], self._tokenizer, [params])[0]
        self._history += turn + out.token_ids
        out.prompt_token_ids = turn
        return out

    def chat(self, messages: Sequence[dict[str, str]], sampling: SamplingParams | None = None,
             on_token: Callable[[int, int], None] | None = None) -> GenerationOutput:
        """Continue the conversation ``messages`` (all of it so far, ending with the new user
        message): the chat template is applied to the whole conversation and only the tokens after
        the cached history are sent.

        Raises:
            ValueError: the templated conversation does not start with this session's history
                (e.g. an earlier reply was edited).
        """
        ids = chat_ids(self._tokenizer, messages)
        with self._hold(f"session {self._slot} chat", (messages, sampling)):
            n = len(self._history)
            if ids[:n] != self._history:
                at = next((i for i, (a, b) in enumerate(zip(ids, self._history)) if a != b), min(n, len(ids)))
                raise ValueError(f"the conversation does not continue this session: its tokens differ from the "
                                 f"cached history at token {at} of {n}")
            return self._send(ids[n:], sampling, on_token)

    def close(self) -> None:
        """Free the session's cache slot (idempotent; no collective: a rank may close alone while
        unwinding an error)."""
        with self._hold(f"session {self._slot} close", None):
            if not self.closed:
                self.closed = True
                self._engine.truncate(self._slot, 0)
                self._release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
