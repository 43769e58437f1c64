#!/usr/bin/env python
"""Convert checkpoints: Hugging Face / GGUF -> megacp (TP-sharded), megacp -> Hugging Face, reshard,
DeepSpeed checkpoints of ``python -m megacp.train`` -> megacp / Hugging Face.

Run ``python tools/convert_checkpoint.py --help`` (or ``python -m megacp.checkpoint.convert``) with
megacp installed (``scripts/setup_env.sh``); the implementation is
:mod:`megacp.checkpoint.convert`.
"""

import sys

from megacp.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
