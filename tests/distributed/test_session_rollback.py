"""A session turn that fails part-way (an ``on_token`` callback raising, ``KeyboardInterrupt``)
leaves the session's history and cache slot exactly as before: the retried turn equals
transformers' greedy reply on the joined history, at CP = 1 and 2, and the LLM stays usable."""

from __future__ import annotations

import pytest

from tests.distributed.test_session import NEW, _turns, reference
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_models import make_hf_model


def _rollback_body(rank: int, n: int, path: str, turns: list[list[int]]) -> dict:
    from megacp import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    llm = LLM(path, dtype="float32", max_sessions=1, max_session_tokens=512)

    def fail_after(count: int, error: BaseException):
        def on_token(request: int, token: int) -> None:
            nonlocal count
            count -= 1
            if count == 0:
                raise error
        return on_token

    replies, caught = [], []
    with llm.session() as s:
        replies.append(s.send(turns[0], greedy).token_ids)
        for error in (RuntimeError("callback failed"), KeyboardInterrupt()):
            before = (s.history, llm_cache_state(s))
            try:
                s.send(turns[1], greedy, on_token=fail_after(2, error))
            except BaseException as err:  # noqa: B036 - KeyboardInterrupt is the case under test
                caught.append(type(err).__name__)
            assert (s.history, llm_cache_state(s)) == before
        replies.append(s.send(turns[1], greedy).token_ids)
        history = s.history
    with llm.session() as fresh:  # the LLM is still usable after the failed turns
        again = fresh.send(turns[0], greedy).token_ids
    return dict(replies=replies, caught=caught, history=history, again=again)


def llm_cache_state(session) -> tuple:
    """The session slot's cache bookkeeping, comparable with ``==``."""
    return session._engine.snapshot(session._slot)


@pytest.mark.parametrize("n", [1, 2])
def test_failed_turn_rolls_back_and_the_retry_is_exact(n: int, tmp_path) -> None:
    hf = make_hf_model("llama3", tmp_path)
    turns = _turns((40, 11), 3)
    ref = reference(hf, turns)
    joined = [t for turn, reply in zip(turns, ref) for t in turn + reply]
    for got in run_distributed(_rollback_body, n, str(tmp_path), turns):
        assert got["caught"] == ["RuntimeError", "KeyboardInterrupt"]
        assert got["replies"] == ref
        assert got["history"] == joined
        assert got["again"] == ref[0]
