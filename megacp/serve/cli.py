"""``python -m megacp.serve --model PATH``: an OpenAI-compatible server with CP prefill, prefix
reuse and continuous batching (plain Python = CP 1; ``torchrun`` / ``deepspeed`` with a CP config =
CP N: rank 0 serves HTTP, the other ranks run the steps it broadcasts).

Examples::

    python -m megacp.serve --model HF_DIR --port 8000
    torchrun --nproc_per_node 2 -m megacp.serve --model HF_DIR --api-key KEY
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn, Sequence

import torch
import torch.distributed as dist

from megacp.attention.kernels.plans import reuse_plans_across_lengths
from megacp.attention.strategy import STRATEGIES
from megacp.checkpoint.dtypes import DTYPES
from megacp.checkpoint.front import default_model_path
from megacp.generate.llm import LLM, rank_capacity
from megacp.kv_cache import KV_CACHE_DTYPES
from megacp.launch import OneLineArgumentParser, add_launcher_args, launcher_rank, print_error_once
from megacp.serve.protocol import MAX_BODY_BYTES
from megacp.version import __version__

PROG = "megacp.serve"

SWITCH_INTERVAL_S = 5e-4
"""Python's thread switch interval on rank 0 (default 5 ms): the engine thread, back from waiting
on the GPU, gets the interpreter from the HTTP thread within this, not a whole decode step later."""


BATCHED_TOKENS = 2048
"""``--max-num-batched-tokens`` by default, vLLM's rule for its OpenAI server: 8192 on a GPU of at
least :data:`LARGE_GPU_GIB` that is not an A100 (H100, H200), else this. A step prefills the
newcomers' prompts together up to this many tokens, so a decode step of the running batch waits
for at most this many prefill tokens, and a burst of arrivals costs the running streams one slow
step per that many prompt tokens, not one per request."""

BATCHED_TOKENS_LARGE_GPU = 8192
"""``--max-num-batched-tokens`` by default on a GPU of at least :data:`LARGE_GPU_GIB`, not an A100."""

LARGE_GPU_GIB = 70


def default_batched_tokens(device: torch.device) -> int:
    """The default ``--max-num-batched-tokens`` on ``device`` (see :data:`BATCHED_TOKENS`)."""
    if device.type != "cuda":
        return BATCHED_TOKENS
    props = torch.cuda.get_device_properties(device)
    large = props.total_memory >= LARGE_GPU_GIB * 2**30 and "A100" not in props.name
    return BATCHED_TOKENS_LARGE_GPU if large else BATCHED_TOKENS


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (bad values: one line from rank 0, exit 2)."""
    p = OneLineArgumentParser(prog="python -m megacp.serve", error_prefix=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF directory, .gguf file or megacp checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: none)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded together (cache slots; default: 16)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting at most, then 429 (default: 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per request, prompt + output (default: the model's context, at most 4096)")
    p.add_argument("--no-prefix-reuse", action="store_true", help="prefill every prompt whole")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as megacp.generate")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache storage: auto (the model's dtype) or fp8_e4m3 (alias fp8)")
    p.add_argument("--strategy", choices=STRATEGIES, default=None, help="prefill strategy (default: the config's, else auto)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="chunked prefill: tokens per chunk (0 = automatic: sized from the free GPU memory on CUDA, "
                        "the whole prompt on CPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="prefill tokens a step that decodes running requests computes at most, over all the "
                        "waiting requests it admits (prefilled together); prompts arriving then are split into "
                        f"chunks of this size (0 = no limit: newcomers are prefilled whole; default: "
                        f"{BATCHED_TOKENS_LARGE_GPU} on a GPU of >= {LARGE_GPU_GIB} GiB but A100, else {BATCHED_TOKENS})")
    p.add_argument("--no-cuda-graphs", "--enforce-eager", dest="no_cuda_graphs", action="store_true",
                   help="run the running batch's decode step eagerly instead of replaying CUDA graphs")
    p.add_argument("--deepspeed", action="store_true", help="DeepSpeed's own flag, accepted for its launchers")
    p.add_argument("--max-request-bytes", type=int, default=MAX_BODY_BYTES,
                   help="largest request body; larger ones get 413 as they arrive (default: 32 MiB)")
    p.add_argument("--version", action="version", version=f"megacp {__version__}")
    add_launcher_args(p)
    args = p.parse_args(argv)
    for name in ("max_num_seqs", "max_queue", "max_request_bytes"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 0:
        p.error(f"--max-num-batched-tokens must be >= 0 (0 = no limit), got {args.max_num_batched_tokens}")
    if args.prefill_chunk < 0 or (args.max_model_len is not None and args.max_model_len < 2):
        p.error("--prefill-chunk must be >= 0 and --max-model-len >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM / Ctrl-C (then drain: running requests finish), exit 0."""
    args = parse_args(argv)
    from megacp.checkpoint import CheckpointError
    from megacp.config import ConfigError

    try:
        return _serve(args)
    except (ConfigError, CheckpointError, ValueError) as err:
        print_error_once(PROG, str(err))
        return 2


def entry() -> NoReturn:
    """``python -m megacp.serve`` and ``megacp-serve``: :func:`main`, then the process ends with its
    status without the interpreter's finalization (by then megacp has closed what it owns; triton's
    nanobind extension would otherwise print dozens of "leaked" objects at every exit)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def _drain_on_signals(server: Any) -> Iterator[None]:
    """SIGTERM / SIGINT: uvicorn stops accepting, the app's lifespan drains the engine, and the
    process exits 0 (uvicorn's own handlers re-raise the signal at exit)."""
    def stop(*_: object) -> None:
        server.should_exit = True

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace) -> int:
    from megacp.generate.cli import _set_threads
    from megacp.generate.engine import decoder_worker
    from megacp.launch.watch import watch_launcher
    from megacp.parallel import initialize

    watch_launcher(PROG)  # a SIGKILLed launcher ends this rank too
    _set_threads(PROG)
    reuse_plans_across_lengths()  # no attention backward runs in this process (see attention.plans)
    # the HTTP rank takes its port before anything loads: a busy port is one line, not a model load later
    listener = listen(args.host, args.port) if launcher_rank() == 0 else None
    state = initialize(args.deepspeed_config)
    model_path = args.model or default_model_path()
    llm = LLM(model_path, dtype=args.dtype, strategy=args.strategy, prefill_chunk=args.prefill_chunk,
              kv_cache_dtype=args.kv_cache_dtype, cuda_graphs=False if args.no_cuda_graphs else None, state=state)
    cfg = llm.model_config
    max_len = min(args.max_model_len or min(cfg.max_position_embeddings, 4096), cfg.max_position_embeddings)
    n = llm.generator.cp_size
    worker = decoder_worker(llm.generator, args.max_num_seqs, rank_capacity(max_len, n), vocab=cfg.vocab_size,
                            shared=True)
    # everything built so far (modules, model, tokenizer, graphs) is never garbage: later
    # collections walk only what serving creates, not millions of objects mid-request
    gc.collect()
    gc.freeze()
    if state.rank != 0:  # a launcher's SIGTERM reaches every rank: rank 0 drains, then stops the others
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        worker.follow()
        dist.destroy_process_group()
        return 0
    import uvicorn

    from megacp.serve.app import build_app
    from megacp.serve.engine import Engine

    batched = args.max_num_batched_tokens
    engine = Engine(worker, llm.tokenizer, max_queue=args.max_queue, prefix_reuse=not args.no_prefix_reuse,
                    max_batched_tokens=default_batched_tokens(state.device) if batched is None else batched)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    name = args.served_model_name or (args.model and Path(args.model).name) or "megacp"
    app = build_app(engine, cfg, model_name=name, max_model_len=max_len, api_key=args.api_key,
                    max_body_bytes=args.max_request_bytes)
    print(f"megacp.serve: {name} CP={n} decode={worker.decode_mode} on http://{args.host}:{args.port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    server.capture_signals = lambda: _drain_on_signals(server)  # type: ignore[method-assign]
    # /health answers 503 for a few seconds (load balancers see why), then the server exits
    engine.on_failure = lambda: threading.Timer(FAILED_HEALTH_S, setattr, (server, "should_exit", True)).start()
    server.run(sockets=[listener] if listener is not None else None)
    if engine.failure is not None:  # a CP rank died or froze: the other ranks are stopped by the launcher
        print_error_once(PROG, f"the engine stopped: {engine.failure}")
        return 3
    dist.destroy_process_group()
    return 0


FAILED_HEALTH_S = 5.0
"""Seconds a server whose engine died keeps answering (``/health``: 503 with the reason) before it exits."""


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (what uvicorn then serves on).

    Raises:
        ValueError: the address cannot be taken (in use, not this machine's): one line naming it.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err})") from None
    sock.set_inheritable(True)
    return sock
