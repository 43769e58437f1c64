"""What every megacp entry point (``python -m megacp.generate`` / ``train`` / ``serve``) needs of
its launcher: the arguments ``deepspeed`` / ``torchrun`` pass (:func:`add_launcher_args`), this
process's rank before any process group exists (:func:`launcher_rank`), one error line from rank 0
(:func:`print_error_once`, :class:`OneLineArgumentParser`), and the end of a rank whose launcher is
gone (:func:`megacp.launch.watch.watch_launcher`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, NoReturn


def add_launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments every megacp script must accept under ``deepspeed``/``torchrun``.

    ``--local_rank``/``--local-rank`` (int; the DeepSpeed launcher appends it, megacp itself reads
    the ``LOCAL_RANK`` environment variable) and ``--deepspeed_config``/``--deepspeed-config``
    (path of the DeepSpeed JSON holding megacp's sections). Returns ``parser``.
    """
    parser.add_argument(
        "--local_rank", "--local-rank", dest="local_rank", type=int,
        default=int(os.environ.get("LOCAL_RANK", "0")),
        help="local rank passed by the launcher (default: $LOCAL_RANK or 0)",
    )
    parser.add_argument(
        "--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
        help="DeepSpeed JSON/hjson config with megacp's context_parallel section",
    )
    return parser


ERROR_LINGER_S = 10.0
"""Seconds a launched rank other than 0 waits before it exits on an error that every rank meets."""


def launcher_rank() -> int:
    """This process's global rank as the launcher set it (``$RANK``; 0 without a launcher), known
    before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def print_error_once(prefix: str, message: str) -> None:
    """Print ``<prefix>: <message>`` as one stderr line (whitespace collapsed) from the launcher's
    rank 0 only (``$RANK``): every rank of a job fails alike, and one line says it. Called just
    before the rank exits. The other ranks of a launched job first wait up to
    :data:`ERROR_LINGER_S`: a launcher stops the whole job when its first rank exits, and a rank 0
    that reached the error later (still importing, say) would be stopped before it said it."""
    if launcher_rank() == 0:
        print(f"{prefix}: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(ERROR_LINGER_S)


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line from rank 0 (:func:`print_error_once` with
    ``error_prefix``) and exit status 2, without argparse's usage block."""

    def __init__(self, *args: Any, error_prefix: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.error_prefix = error_prefix

    def error(self, message: str) -> NoReturn:
        print_error_once(self.error_prefix, message)
        sys.exit(2)
