"""Command line for checkpoint conversion (``tools/convert_checkpoint.py``).

Subcommands::

    hf-to-megacp   --input HF_DIR    --output DIR [--tp N] [--dtype D] [--force]
    gguf-to-megacp --input FILE.gguf --output DIR [--tp N] [--dtype D] [--force]
    megacp-to-hf   --input DIR       --output HF_DIR [--force]
    reshard        --input DIR       --output DIR --tp M [--force]
    deepspeed-to-megacp --input DS_DIR --output DIR    [--tag T] [--tp N] [--dtype D] [--force]
    deepspeed-to-hf     --input DS_DIR --output HF_DIR [--tag T] [--dtype D] [--force]

(``DS_DIR``: a ``python -m megacp.train --save`` directory, ZeRO shards included. Every subcommand
takes ``--allow-non-finite``: without it a tensor holding NaN or inf is refused.)

Each streams tensors from input to output with a progress bar and ends with one summary line on
stdout. Bad input, a full disk or a read-only destination ends with one ``error: ...`` line on
stderr and exit status 2; the output is written into a staging directory that is renamed into place
only on success, so nothing is left behind on error, Ctrl-C (status 130) or SIGTERM (143); the
leftovers of a writer killed outright are removed by the next write into the same directory.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from megacp.checkpoint.dtypes import DTYPES, dtype_from_name
from megacp.checkpoint.errors import CheckpointError
from megacp.checkpoint.hf import (
    hf_names_of,
    hf_parameter_shapes,
    hf_to_megacp,
    megacp_to_hf,
    open_hf_checkpoint,
    own_architectures,
    save_hf_checkpoint,
    transformers_only,
)
from megacp.checkpoint.megacp_format import open_megacp_checkpoint, save_megacp_checkpoint
from megacp.checkpoint.safetensors_io import WriteSummary
from megacp.checkpoint.staging import check_output_dir
from megacp.checkpoint.tp import check_tp_size
from megacp.checkpoint.values import check_finite
from megacp.models.schema import parameter_shapes

Command = Callable[[argparse.Namespace], WriteSummary]


TRUST_HELP = ("unpickle the DeepSpeed files without checking that they hold only tensors and plain data "
              "(a downloaded checkpoint could run code); only for checkpoints you made or trust")


@contextmanager
def _progress(
    tensors: Iterable[tuple[str, torch.Tensor]], total: int, args: argparse.Namespace
) -> Iterator[Iterable[tuple[str, torch.Tensor]]]:
    """A tqdm bar over a tensor stream (shown only on a terminal), closed even on error so that
    an error line starts on a fresh line; a non-finite tensor is refused unless
    ``--allow-non-finite``."""
    if not args.allow_non_finite:
        tensors = ((name, check_finite(name, t, args.input)) for name, t in tensors)
    with tqdm(tensors, total=total, desc=args.command, unit="tensor", disable=None) as bar:
        yield bar


def _check_converts(path: str) -> None:
    """Refuse, in one line, a Hugging Face directory of an architecture megacp's own models do not
    implement, naming those they do and where the directory runs as it is."""
    if not transformers_only(path):
        return
    config = json.loads((Path(path) / "config.json").read_text())
    name = ", ".join(map(str, config.get("architectures") or [])) or repr(config.get("model_type"))
    raise CheckpointError(f"unsupported architecture {name}; hf-to-megacp converts the architectures megacp's own "
                          f"models implement: {', '.join(own_architectures())}. megacp.train, megacp.generate, "
                          "megacp.serve and LLM take a directory of another architecture as it is (transformers' "
                          "modules with megacp's attention, where that runs it)")


def _hf_to_megacp(args: argparse.Namespace) -> WriteSummary:
    _check_converts(args.input)
    check_output_dir(args.output, force=args.force)
    with open_hf_checkpoint(args.input) as source:
        cfg = source.config
        check_tp_size(cfg, args.tp)
        if args.dtype is None:  # keep the stored dtype
            dtype = source.get(hf_names_of("embedding.weight")[0]).dtype
        else:
            dtype = dtype_from_name(args.dtype)
        tensors = hf_to_megacp(cfg, source.get, source.names)
        with _progress(tensors, len(parameter_shapes(cfg)), args) as stream:
            return save_megacp_checkpoint(
                args.output,
                cfg,
                stream,
                dtype=dtype,
                tp_size=args.tp,
                tokenizer=source.path,
                force=args.force,
            )


def _gguf_to_megacp(args: argparse.Namespace) -> WriteSummary:
    from megacp.checkpoint.gguf import load_gguf  # imports the gguf package and transformers

    check_output_dir(args.output, force=args.force)
    cfg, tensors, tokenizer = load_gguf(args.input)
    check_tp_size(cfg, args.tp)
    dtype = dtype_from_name(args.dtype or "float32")
    with _progress(tensors, len(parameter_shapes(cfg)), args) as stream:
        return save_megacp_checkpoint(
            args.output, cfg, stream, dtype=dtype, tp_size=args.tp, tokenizer=tokenizer, force=args.force
        )


def _megacp_to_hf(args: argparse.Namespace) -> WriteSummary:
    check_output_dir(args.output, force=args.force)
    with open_megacp_checkpoint(args.input) as source:
        cfg = source.config
        tensors = megacp_to_hf(cfg, source.get, source.names)
        with _progress(tensors, len(hf_parameter_shapes(cfg)), args) as stream:
            return save_hf_checkpoint(
                args.output, cfg, stream, dtype=source.dtype, tokenizer=source.path, force=args.force
            )


def _reshard(args: argparse.Namespace) -> WriteSummary:
    check_output_dir(args.output, force=args.force)
    with open_megacp_checkpoint(args.input) as source:
        check_tp_size(source.config, args.tp)
        with _progress(source.iter_tensors(), len(source.names), args) as stream:
            return save_megacp_checkpoint(
                args.output,
                source.config,
                stream,
                dtype=source.dtype,
                tp_size=args.tp,
                tokenizer=source.path,
                force=args.force,
            )


def _deepspeed_dtype(args: argparse.Namespace, trained: torch.dtype) -> torch.dtype:
    return dtype_from_name(args.dtype) if args.dtype else trained


def _deepspeed_to_megacp(args: argparse.Namespace) -> WriteSummary:
    from megacp.checkpoint.deepspeed import read_deepspeed_checkpoint

    check_output_dir(args.output, force=args.force)
    source = read_deepspeed_checkpoint(args.input, args.tag, trust=args.trust_checkpoint)
    check_tp_size(source.config, args.tp)
    with _progress(source.tensors.items(), len(source.tensors), args) as stream:
        return save_megacp_checkpoint(args.output, source.config, stream, dtype=_deepspeed_dtype(args, source.dtype),
                                      tp_size=args.tp, tokenizer=source.path, force=args.force)


def _deepspeed_to_hf(args: argparse.Namespace) -> WriteSummary:
    """The trained model as a Hugging Face directory, written as what the checkpoint records of its
    model says (:meth:`~megacp.checkpoint.deepspeed.ModelRecord.write_hf`)."""
    from megacp.checkpoint.deepspeed import read_record

    check_output_dir(args.output, force=args.force)
    return read_record(args.input).write_hf(
        args.input, args.tag, output=args.output, dtype=dtype_from_name(args.dtype) if args.dtype else None,
        force=args.force, trust=args.trust_checkpoint, progress=lambda tensors, total: _progress(tensors, total, args))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the converter."""
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description="Convert Hugging Face / GGUF checkpoints to megacp's TP-sharded layout and back.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(
        name: str, help_text: str, run: Command, input_help: str, output_help: str
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--input", required=True, help=input_help)
        sub.add_argument("--output", required=True, help=output_help)
        sub.add_argument("--force", action="store_true", help="replace an existing output checkpoint")
        sub.add_argument("--allow-non-finite", action="store_true", help="convert tensors holding NaN or inf")
        sub.set_defaults(run=run)
        return sub

    dtype_help = f"stored dtype ({', '.join(DTYPES)}); default: %s"
    sub = command("hf-to-megacp", f"Hugging Face directory ({', '.join(own_architectures())}) -> megacp checkpoint",
                  _hf_to_megacp,
                  "Hugging Face checkpoint directory", "megacp checkpoint directory to create")
    sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    sub.add_argument("--dtype", choices=list(DTYPES), help=dtype_help % "the input's")
    sub = command("gguf-to-megacp", "GGUF file -> megacp checkpoint (dequantised)", _gguf_to_megacp,
                  "GGUF file", "megacp checkpoint directory to create")
    sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    sub.add_argument("--dtype", choices=list(DTYPES), help=dtype_help % "float32")
    command("megacp-to-hf", "megacp checkpoint -> Hugging Face directory", _megacp_to_hf,
            "megacp checkpoint directory", "Hugging Face directory to create")
    sub = command("reshard", "megacp checkpoint -> megacp checkpoint with another TP size", _reshard,
                  "megacp checkpoint directory", "megacp checkpoint directory to create")
    sub.add_argument("--tp", type=int, required=True, help="new tensor-parallel size")
    ds_input = "DeepSpeed checkpoint directory written by python -m megacp.train --save"
    ds_dtype = dtype_help % "the dtype it was trained in"
    sub = command("deepspeed-to-megacp", "megacp.train DeepSpeed checkpoint (ZeRO shards merged) -> megacp checkpoint",
                  _deepspeed_to_megacp, ds_input, "megacp checkpoint directory to create")
    sub.add_argument("--tag", help="checkpoint tag (default: the one DeepSpeed's 'latest' file names)")
    sub.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    sub.add_argument("--dtype", choices=list(DTYPES), help=ds_dtype)
    sub.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    sub = command("deepspeed-to-hf", "megacp.train DeepSpeed checkpoint (ZeRO shards merged) -> Hugging Face directory",
                  _deepspeed_to_hf, ds_input, "Hugging Face directory to create")
    sub.add_argument("--tag", help="checkpoint tag (default: the one DeepSpeed's 'latest' file names)")
    sub.add_argument("--dtype", choices=list(DTYPES), help=ds_dtype)
    sub.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised where the program runs so that a half-written output is removed as on Ctrl-C."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the converter; returns the exit status: 0, 2 on bad input (an unreadable input or an
    output the destination cannot take included), 130 on Ctrl-C, 143 on SIGTERM (the output is
    left untouched in the last three cases)."""
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = args.run(args)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # reading the input; errors of the output are CheckpointErrors
        print(f"error: {err.filename or args.input}: {err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; {args.output} was not written", file=sys.stderr)
        return 130
    except Terminated:
        print(f"error: terminated (SIGTERM); {args.output} was not written", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    seconds = time.perf_counter() - start
    print(
        f"{args.command}: wrote {summary.tensors} tensors, {summary.bytes:,} bytes "
        f"({summary.bytes / 2**20:.1f} MiB) to {args.output} in {seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
