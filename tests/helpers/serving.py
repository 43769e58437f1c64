"""Serving helpers shared by the server's tests and its GPU check program: the requests, and a
driver that runs them through a :class:`~megacp.serve.worker.Worker` as the engine's step loop does."""

from __future__ import annotations

import torch


def prompts() -> list[list[int]]:
    """16 random prompts of 3 to 39 token ids (the serving tests' requests)."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (16,), generator=g)]


def drive(worker, prompts: list[list[int]], params: list) -> list[list[int]]:
    """Run ``prompts`` through ``worker`` as the engine does: newcomers join a running batch
    (1 to 3 a step, as slots free up), finished requests leave it, every step decodes the batch."""
    from megacp.serve.worker import Admit, Work

    out: list[list[int]] = [[] for _ in prompts]
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
        for i, t in zip(admitted, res.first):
            out[i].append(t)
        if res.tokens is not None:
            for s, t in zip(sorted(batch), res.tokens.tolist()):
                if len(out[batch[s]]) < params[batch[s]].max_tokens:
                    out[batch[s]].append(t)
        step += 1
    return out
