"""Serving helpers shared by the server's tests and its GPU check program: the requests, and a
driver that runs them through a :class:`~megacp.generate.worker.Worker` as the engine's step loop does."""

from __future__ import annotations

import torch


def prompts() -> list[list[int]]:
    """16 random prompts of 3 to 39 token ids (the serving tests' requests)."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (16,), generator=g)]


def drive(worker, prompts: list[list[int]], params: list) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Run ``prompts`` through ``worker`` as the engine does: newcomers join a running batch
    (1 to 3 a step, as slots free up), finished requests leave it, every step decodes the batch.
    Returns each request's tokens and, per token, the ``{token: logprob}`` it asked for (empty
    lists for requests without ``logprobs``)."""
    from megacp.generate.sampling import logprob_dicts
    from megacp.generate.worker import Admit, Work

    out: list[list[int]] = [[] for _ in prompts]
    lps: list[list[dict[int, float]]] = [[] for _ in prompts]

    def take(i: int, token: int, logprobs: dict[int, float] | None) -> None:
        if len(out[i]) < params[i].max_tokens:
            out[i].append(token)
            if logprobs is not None:
                lps[i].append(logprobs)

    waiting, batch, free, step = list(range(len(prompts))), {}, list(worker.slots), 0
    while waiting or batch:
        work, admitted = Work(), []
        done = [s for s, i in batch.items() if len(out[i]) >= params[i].max_tokens]
        for s in done:
            del batch[s]
            free.append(s)
        while waiting and free and len(admitted) < step % 3 + 1:
            i, s = waiting.pop(0), free.pop(0)
            work.truncate.append((s, 0))
            work.admit.append(Admit(s, prompts[i], params[i], prompts[i]))
            batch[s] = i
            admitted.append(i)
        if done or admitted:
            work.batch = sorted(batch)
        res = worker.run(work)
        for i, t, lp in zip(admitted, res.first, res.first_logprobs):
            take(i, t, lp)
        if res.tokens is not None:
            rows, toks = [batch[s] for s in sorted(batch)], res.tokens.tolist()
            dicts: list = [None] * len(rows)
            if res.logprobs is not None:
                chosen, top_ids, top_values = (t.tolist() for t in res.logprobs)
                dicts = logprob_dicts(toks, chosen, top_ids, top_values, [params[i].logprobs for i in rows])
            for i, t, lp in zip(rows, toks, dicts):
                take(i, t, lp)
        step += 1
    return out, lps


def logprobs_close(got: list[list[dict[int, float]]], want: list, tol: float) -> bool:
    """Whether each request's per-token ``{token: logprob}`` of ``got`` (:func:`drive`'s) hold the
    tokens of ``want``'s (``GenerationOutput.logprobs``; ``None``: not asked) with values within ``tol``."""
    return len(got) == len(want) and all(
        len(g) == len(w or []) and all(a.keys() == b.keys() and all(abs(a[t] - b[t]) <= tol for t in a)
                                       for a, b in zip(g, w or []))
        for g, w in zip(got, want))
