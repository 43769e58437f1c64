#!/usr/bin/env python
"""Convert checkpoints: Hugging Face / GGUF -> megacp (TP-sharded), megacp -> Hugging Face, reshard,
DeepSpeed checkpoints of ``python -m megacp.train`` -> megacp / Hugging Face.

Run ``python tools/convert_checkpoint.py --help``; the implementation is
:mod:`megacp.checkpoint.convert`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from megacp.checkpoint.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
