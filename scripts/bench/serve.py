#!/usr/bin/env python3
"""Serving benchmark: starts ``python -m megacp.serve`` on a random-weight model (a subprocess),
waits for ``/health`` and runs two phases against it over HTTP (streaming ``/v1/completions`` with
token-id prompts, greedy, no stop tokens).

    python -m scripts.bench.serve --json out/serve.json   # Llama-3.1-8B shape, 16 layers, one GPU
    python -m scripts.bench.serve --tiny                  # a CPU smoke run of a tiny shape
    python -m scripts.bench.serve --url http://127.0.0.1:8000 --served-model NAME --vocab V  # a running server

* **streams**: one client alone, then ``--clients`` concurrent ones (all sent at once, spread over
  ``--client-procs`` processes so the clients' own parsing does not pace them), each a random
  ``--prompt-len`` prompt and exactly ``--max-tokens`` tokens. Throughput: every token of every
  client over the phase's wall time (first request sent to last token), tokens/s; the ratio is
  to the single stream's. Inter-token latency: gaps between a request's consecutive streamed
  tokens as the client receives them, p50 / p90 / p99 / max, and how many gaps exceed twice the
  single stream's p99 (the server's ``--max-num-batched-tokens`` bounds the prefill a decode step
  waits for; the steps that prefilled the concurrent prompts are ``prefill_steps``, the chunk
  counters are in ``server_metrics``). Targets: ratio >= 8, p99 ITL < 2x the
  single stream's p99.
* **chat**: one conversation of ``--turns`` turns over a random ``--history``-token history: each
  turn adds ``--turn-len`` new tokens, streams a ``--reply-len`` reply and keeps it in the history
  (the server reuses the cached prefix). Before each turn, a cold prefill of a fresh prompt of the
  same length (no shared prefix, one token) gives the TTFT without reuse. Target: every turn that
  reuses the cached history (all but the first, which has nothing cached) has a TTFT < 10% of its
  cold TTFT. A warm-up conversation of the same shape comes first (``--chat-warmup`` turns, default
  3: a first turn and two that reuse its history, each after its cold prefill, other random
  tokens; printed and in the JSON as ``warmup``, not in the target), as serving benchmarks send
  warm-up requests before measuring: the first prefills of a length and the first pass-Q prefill
  over a cached history pay one-time costs (cuDNN plans per power-of-two length bucket under
  ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, kernel compilation), which the measured turns then do not.

Shapes: ``llama8b`` (Llama-3.1-8B: 32 Q / 8 KV heads of 128, hidden 4096, vocab 128256) with
``--layers`` layers (default 16), bf16 on CUDA; ``--tiny``: a 2-layer shape, fp32 on CPU, small
phases. The random model is saved with a word-level tokenizer to a temporary directory (as
:mod:`scripts.bench.decode_kinds` does); the server gets ``--max-num-seqs = --clients`` and a
``--max-model-len`` that fits the chat. Prints each phase and the ratios; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]

TARGET_RATIO, TARGET_ITL, TARGET_TTFT = 8.0, 2.0, 0.10
"""Streams: throughput ratio at least, p99 ITL ratio below; chat: turn TTFT / cold TTFT below."""

SIZES = dict(clients=32, prompt_len=256, max_tokens=256, client_procs=8, history=32768, turns=10, turn_len=64,
             reply_len=32)
"""The phases' sizes by default."""

TINY = dict(clients=4, prompt_len=16, max_tokens=8, client_procs=1, history=192, turns=3, turn_len=8, reply_len=4)
"""The phases' sizes under ``--tiny``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny shape on CPU with small phases (a smoke run)")
    p.add_argument("--layers", type=int, default=16, help="layers of the Llama-3.1-8B shape (default: 16)")
    p.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    p.add_argument("--served-model", default="bench", help="the model's name in the API (with --url: the server's)")
    p.add_argument("--api-key", default=None, help="with --url: the server's API key")
    p.add_argument("--vocab", type=int, default=None, help="with --url: token ids are drawn from [3, vocab)")
    p.add_argument("--clients", type=int, help="concurrent streams (default: 32)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens of each stream (default: 256)")
    p.add_argument("--max-tokens", type=int, help="tokens of each stream (default: 256)")
    p.add_argument("--client-procs", type=int, help="processes the concurrent clients are spread over (default: 8)")
    p.add_argument("--history", type=int, help="the chat's initial history, tokens (default: 32768)")
    p.add_argument("--turns", type=int, help="chat turns (default: 10)")
    p.add_argument("--turn-len", type=int, help="new tokens of each chat turn (default: 64)")
    p.add_argument("--reply-len", type=int, help="tokens of each chat reply (default: 32)")
    p.add_argument("--chat-warmup", type=int, default=3,
                   help="turns of the unmeasured warm-up conversation before the chat (at most --turns; "
                        "0 = none; default: 3)")
    p.add_argument("--server-args", default="", help="more arguments for python -m megacp.serve (one string)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the server may take to come up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    for name, value in (TINY if args.tiny else SIZES).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("layers", *SIZES):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.chat_warmup < 0:
        p.error(f"--chat-warmup must be >= 0, got {args.chat_warmup}")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (inter-token latency needs two tokens)")
    if args.url is not None and args.vocab is None:
        p.error("--url needs --vocab (the token ids the random prompts are drawn from)")
    if args.url is None and not args.tiny:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA GPU here: this benchmark serves on the GPU; --tiny runs a CPU smoke test")
    return args


# ---------------------------------------------------------------------------- the server
def model_shape(args: argparse.Namespace) -> dict[str, Any]:
    """The Hugging Face config of the benchmark's model."""
    from scripts.bench.decode_hf import MODELS
    from scripts.bench.decode_kinds import TINY as TINY_MODEL

    if args.tiny:
        return dict(TINY_MODEL[0])
    return dict(MODELS["llama8b"], num_hidden_layers=args.layers)


def max_model_len(args: argparse.Namespace) -> int:
    """Tokens per request the server must allow: the chat's longest prompt plus its reply, or a
    stream's prompt plus its tokens."""
    chat = args.history + args.turns * (args.turn_len + args.reply_len) + 16
    return max(chat, args.prompt_len + args.max_tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_model(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """Save the random model and its tokenizer to ``directory``; what the JSON records of it."""
    import torch

    from scripts.bench.decode_kinds import save_random_model

    shape = model_shape(args)
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], max_model_len(args))
    device = torch.device("cpu" if args.tiny else "cuda")
    torch.manual_seed(args.seed)
    model, _ = save_random_model(shape, directory, torch.float32 if args.tiny else torch.bfloat16, device)
    del model
    info = {"shape": "tiny" if args.tiny else f"llama8b ({args.layers} layers)", "layers": shape["num_hidden_layers"],
            "vocab": shape["vocab_size"], "device": "cpu" if args.tiny else torch.cuda.get_device_name()}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info


def start_server(args: argparse.Namespace, model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megacp.serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", args.served_model, "--max-num-seqs", str(args.clients),
           "--max-model-len", str(max_model_len(args)), *(["--dtype", "float32"] if args.tiny else []),
           *shlex.split(args.server_args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    print("server:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen | None, url: str, timeout: float, log: Path | None) -> float:
    """Seconds until ``url``/health answers 200 (raises if the server exits or the time runs out)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log is not None else ""
            raise RuntimeError(f"the server exited with status {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer {url}/health within {timeout:.0f} s")


# ---------------------------------------------------------------------------- clients
def pct(xs: list[float], q: float) -> float:
    """The ``q``-quantile of ``xs`` (nearest rank; 0 for none)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming completion: send time and token arrival times (``time.perf_counter``, s; the
    same clock in every process on Linux), token ids, cached prompt tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []
    cached = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed the request: {chunk['error']}")
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            new = chunk["choices"][0]["token_ids"] if chunk["choices"] else []
            ids += new
            stamps += [time.perf_counter()] * len(new)
    if len(ids) != max_tokens:
        raise RuntimeError(f"a request asked for {max_tokens} tokens and got {len(ids)}")
    return {"sent": sent, "stamps": stamps, "ids": ids, "cached": cached}


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def run_streams(url: str, model: str, api_key: str | None, prompts: list[list[int]], max_tokens: int,
                start_at: float) -> list[dict[str, Any]]:
    """Stream every prompt at once from this process, starting at ``start_at`` (perf_counter)."""
    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=len(prompts) + 4)
        async with httpx.AsyncClient(timeout=None, headers=_headers(api_key), limits=limits) as client:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            return list(await asyncio.gather(*(stream(client, url, model, p, max_tokens) for p in prompts)))

    return asyncio.run(main())


def streams_phase(args: argparse.Namespace, url: str, n: int, rng: random.Random, vocab: int,
                  pool: ProcessPoolExecutor | None, slow_ms: float = 0.0) -> dict[str, Any]:
    """``n`` concurrent streams: throughput and inter-token latency (``slow_gaps``: gaps over ``slow_ms``)."""
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(n)]
    procs = 1 if pool is None or n == 1 else min(args.client_procs, n)
    parts = [prompts[i::procs] for i in range(procs)]
    start = time.perf_counter() + (0.5 if procs > 1 else 0.0)  # the processes' clients start together
    if procs == 1:
        results = run_streams(url, args.served_model, args.api_key, prompts, args.max_tokens, start)
    else:
        assert pool is not None
        futures = [pool.submit(run_streams, url, args.served_model, args.api_key, part, args.max_tokens, start)
                   for part in parts]
        results = [r for f in futures for r in f.result()]
    first = min(r["sent"] for r in results)
    wall = max(r["stamps"][-1] for r in results) - first
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    ttft = [r["stamps"][0] - r["sent"] for r in results]
    tokens = sum(len(r["ids"]) for r in results)
    return {"clients": n, "tokens": tokens, "wall_s": round(wall, 4), "tok_s": round(tokens / wall, 1),
            "itl_p50_ms": round(1e3 * pct(itl, 0.5), 3), "itl_p90_ms": round(1e3 * pct(itl, 0.9), 3),
            "itl_p99_ms": round(1e3 * pct(itl, 0.99), 3), "itl_max_ms": round(1e3 * max(itl, default=0.0), 3),
            "gaps": len(itl), "slow_gaps": sum(g > slow_ms / 1e3 for g in itl) if slow_ms else 0,
            "ttft_p50_ms": round(1e3 * pct(ttft, 0.5), 2), "ttft_max_ms": round(1e3 * max(ttft), 2)}


def chat_phase(args: argparse.Namespace, url: str, rng: random.Random, vocab: int
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The warm-up conversation (``--chat-warmup`` turns), then the measured one: each turn after
    a cold prefill of its length. The two histories and the two conversations' cold prompts start
    with four different tokens: each conversation's first turn starts from nothing cached, and a
    cold prefill shares at most its first token (with the cold prompts before it)."""
    def other(token: int, k: int) -> int:  # the k-th token id after ``token``, within [3, vocab)
        return 3 + (token - 3 + k) % (vocab - 3)

    async def conversation(client: httpx.AsyncClient, first: int, turns: int) -> list[dict[str, Any]]:
        rows = []
        history = [first] + [rng.randrange(3, vocab) for _ in range(args.history - 1)]
        for turn in range(turns):
            history += [rng.randrange(3, vocab) for _ in range(args.turn_len)]
            cold_prompt = [other(first, 2)] + [rng.randrange(3, vocab) for _ in range(len(history) - 1)]
            cold = await stream(client, url, args.served_model, cold_prompt, 1)
            r = await stream(client, url, args.served_model, history, args.reply_len)
            ttft, cold_ttft = r["stamps"][0] - r["sent"], cold["stamps"][0] - cold["sent"]
            rows.append({"turn": turn, "prompt_tokens": len(history), "cached_tokens": r["cached"],
                         "ttft_ms": round(1e3 * ttft, 2), "cold_ttft_ms": round(1e3 * cold_ttft, 2),
                         "cold_cached_tokens": cold["cached"], "ratio": round(ttft / cold_ttft, 4)})
            history += r["ids"]
        return rows

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        first = rng.randrange(3, vocab)
        async with httpx.AsyncClient(timeout=None, headers=_headers(args.api_key)) as client:
            warmup = await conversation(client, other(first, 1), min(args.chat_warmup, args.turns))
            return warmup, await conversation(client, first, args.turns)

    return asyncio.run(main())


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    meta: dict[str, Any] = {"kind": "serve", "argv": sys.argv if argv is None else argv,
                            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "max_model_len": max_model_len(args)}
    out: dict[str, Any] = {"meta": meta}
    proc = None
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp:
        log = Path(tmp) / "server.log"
        try:
            if args.url is None:
                t0 = time.perf_counter()
                meta.update(save_model(args, Path(tmp) / "model"))
                meta["model_save_s"] = round(time.perf_counter() - t0, 1)
                url = f"http://127.0.0.1:{free_port()}"
                proc = start_server(args, Path(tmp) / "model", int(url.rsplit(":", 1)[1]), log)
                meta["server_start_s"] = round(wait_healthy(proc, url, args.timeout, log), 1)
                print(f"server up in {meta['server_start_s']} s (model saved in {meta['model_save_s']} s)", flush=True)
            else:
                url = args.url.rstrip("/")
                wait_healthy(None, url, args.timeout, None)
            vocab = args.vocab or meta["vocab"]
            stats = httpx.get(url + "/metrics", headers=_headers(args.api_key), timeout=10).json()
            meta["decode"] = stats.get("decode")
            meta["max_num_batched_tokens"] = stats.get("max_num_batched_tokens")
            meta["cudnn_sdpa_avoid_recompile"] = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1 (megacp.serve's default)")
            pool = None
            if args.client_procs > 1:
                pool = ProcessPoolExecutor(args.client_procs, mp_context=multiprocessing.get_context("spawn"))
                list(pool.map(abs, range(2 * args.client_procs)))  # the processes are up before the clock starts
            try:
                streams_phase(args, url, 1, rng, vocab, None)  # warm-up: the first requests' one-time costs
                single = streams_phase(args, url, 1, rng, vocab, None)
                before = httpx.get(url + "/metrics", headers=_headers(args.api_key), timeout=10).json()
                many = streams_phase(args, url, args.clients, rng, vocab, pool, TARGET_ITL * single["itl_p99_ms"])
                after = httpx.get(url + "/metrics", headers=_headers(args.api_key), timeout=10).json()
                many["prefill_steps"] = after.get("prefill_steps", 0) - before.get("prefill_steps", 0)
                many["server_step_ms"] = after.get("step_ms", {})  # the engine's latest steps, host time
            finally:
                if pool is not None:
                    pool.shutdown()
            ratio = many["tok_s"] / single["tok_s"]
            itl_ratio = many["itl_p99_ms"] / single["itl_p99_ms"] if single["itl_p99_ms"] else float("inf")
            out["streams"] = {"single": single, "concurrent": many, "throughput_ratio": round(ratio, 2),
                              "itl_p99_ratio": round(itl_ratio, 3),
                              "ok": ratio >= TARGET_RATIO and itl_ratio < TARGET_ITL}
            for row in (single, many):
                print(f"{row['clients']:>3} streams: {row['tok_s']:9.1f} tok/s  ITL p50 {row['itl_p50_ms']:.2f} "
                      f"p90 {row['itl_p90_ms']:.2f} p99 {row['itl_p99_ms']:.2f} max {row['itl_max_ms']:.2f} ms  "
                      f"TTFT p50 {row['ttft_p50_ms']:.1f} ms", flush=True)
            print(f"{many['slow_gaps']} of {many['gaps']} gaps over {TARGET_ITL:g}x the single stream's p99 "
                  f"(p99 passes while at most {many['gaps'] // 100}); the {many['clients']} prompts prefilled in "
                  f"{many['prefill_steps']} steps (--max-num-batched-tokens {meta['max_num_batched_tokens']})",
                  flush=True)
            for kind, row in many["server_step_ms"].items():
                print(f"server {kind} steps (latest {row['steps']}): p50 {row['p50']:.2f} p99 {row['p99']:.2f} "
                      f"max {row['max']:.2f} ms", flush=True)
            print(f"throughput {ratio:.2f}x single stream (target >= {TARGET_RATIO:g}), p99 ITL {itl_ratio:.2f}x "
                  f"(target < {TARGET_ITL:g})", flush=True)
            warmup, turns = chat_phase(args, url, rng, vocab)
            reuse = [t["ratio"] for t in turns if t["cached_tokens"] > 0]
            worst = max(reuse, default=float("inf"))
            out["chat"] = {"warmup": warmup, "turns": turns, "worst_ratio": worst, "ok": worst < TARGET_TTFT}
            for label, rows in (("warm-up turn", warmup), ("turn", turns)):
                for t in rows:
                    print(f"{label} {t['turn']:>2}: {t['prompt_tokens']} tokens ({t['cached_tokens']} cached)  TTFT "
                          f"{t['ttft_ms']:.1f} ms  cold {t['cold_ttft_ms']:.1f} ms  ratio {t['ratio']:.3f}",
                          flush=True)
            print(f"chat TTFT of the turns that reuse the history at most {worst:.3f} of a cold prefill "
                  f"(target < {TARGET_TTFT:g})", flush=True)
            stats = httpx.get(url + "/metrics", headers=_headers(args.api_key), timeout=10).json()
            out["server_metrics"] = stats
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    meta["server_exit"] = proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    meta["server_exit"] = "killed"
                if log.exists() and (meta["server_exit"] != 0):
                    print(log.read_text()[-4000:], flush=True)
            meta["total_s"] = round(time.perf_counter() - t_start, 1)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(out, indent=1))
                print(f"JSON: {args.json}", flush=True)
    ok = out.get("streams", {}).get("ok") and out.get("chat", {}).get("ok")
    print(f"total {meta['total_s']} s; targets: {'met' if ok else 'NOT met'}", flush=True)
    return 0 if "chat" in out else 1


if __name__ == "__main__":
    sys.exit(main())
