"""Serving benchmark against a running ``python -m megacp.serve``: N concurrent streaming clients,
then a multi-turn chat trace whose conversations share a system prefix and grow turn by turn.
Prints throughput (generated tokens/s), TTFT and inter-token latency p50/p99 (ms), and the prompt
tokens the server reused from its cache. Compare prefix reuse against a server started with
``--no-prefix-reuse``.

    python scripts/bench/serve.py --url http://127.0.0.1:8000 --model NAME --clients 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx


def pct(xs: list[float], q: float) -> float:
    """The ``q``-quantile of ``xs`` in ms (0 for none)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


async def stream(client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    """One streaming completion: its TTFT (s), inter-token gaps (s), token count and ids, cached prompt tokens."""
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, ids, cached = [], [], 0
    async with client.stream("POST", args.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            new = chunk["choices"][0]["token_ids"] if chunk["choices"] else []
            ids += new
            stamps += [time.perf_counter()] * len(new)
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": len(stamps),
            "ids": ids, "cached": cached}


def summary(name: str, results: list[dict[str, Any]], wall: float) -> None:
    toks = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    print(f"{name}: {len(results)} requests, {toks / wall:.1f} tok/s, TTFT p50 {pct(ttft, .5):.1f} p99 "
          f"{pct(ttft, .99):.1f} ms, ITL p50 {pct(itl, .5):.1f} p99 {pct(itl, .99):.1f} ms, "
          f"cached prompt tokens {sum(r['cached'] for r in results)}")


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=None, headers=headers) as client:
        for n in sorted({1, args.clients}):
            prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(n)]
            t0 = time.perf_counter()
            res = await asyncio.gather(*(stream(client, args, p) for p in prompts))
            summary(f"{n} concurrent streams", list(res), time.perf_counter() - t0)
        system = [rng.randrange(3, args.vocab) for _ in range(args.system_len)]

        async def conversation() -> list[dict[str, Any]]:
            history, out = list(system), []
            for _ in range(args.turns):
                history += [rng.randrange(3, args.vocab) for _ in range(args.turn_len)]
                r = await stream(client, args, history)
                out.append(r)
                history += r["ids"]  # the reply stays in the conversation
            return out

        t0 = time.perf_counter()
        convs = await asyncio.gather(*(conversation() for _ in range(args.chats)))
        flat = [r for c in convs for r in c]
        summary(f"chat trace ({args.chats} chats x {args.turns} turns)", flat, time.perf_counter() - t0)
        print("chat TTFT per turn (ms, mean):",
              [round(1000 * statistics.mean(c[t]["ttft"] for c in convs), 1) for t in range(args.turns)])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the server's model name (/v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256, help="token ids are drawn from [3, vocab)")
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--turn-len", type=int, default=32)
    asyncio.run(main(p.parse_args()))
