"""``zero_to_fp32.py`` of a ``python -m megacp.train --save`` directory: the trained model as a
Hugging Face directory (config, safetensors under Hugging Face names, tokenizer) that
``transformers`` loads, the ZeRO partitions merged into full fp32 tensors.

``megacp.train`` copies this file into every save directory, where DeepSpeed users look for its
recovery script; it takes that script's arguments::

    python DIR/zero_to_fp32.py DIR HF_DIR [-t step100] [--dtype bfloat16]   # default: float32

and runs megacp's converter (``tools/convert_checkpoint.py deepspeed-to-hf --input DIR --output
HF_DIR``), so the same one-line errors and exit status 2 apply.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

SCRIPT_NAME = "zero_to_fp32.py"
"""The name of this script in a save directory."""


def main(argv: Sequence[str] | None = None) -> int:
    """Convert the checkpoint named by ``argv`` (see the module docstring); returns the converter's exit status."""
    parser = argparse.ArgumentParser(prog=SCRIPT_NAME, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="the megacp.train --save directory (holding 'latest')")
    parser.add_argument("output_dir", help="the Hugging Face directory to create")
    parser.add_argument("-t", "--tag", help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--dtype", default="float32", help="dtype of the written tensors (default: float32)")
    args = parser.parse_args(argv)
    from megacp.checkpoint.convert import main as convert

    return convert(["deepspeed-to-hf", "--input", args.checkpoint_dir, "--output", args.output_dir,
                    "--dtype", args.dtype, *(["--tag", args.tag] if args.tag else [])])


if __name__ == "__main__":
    sys.exit(main())
