"""``python -m megacp.train`` (see :mod:`megacp.train.cli`)."""

import sys

from megacp.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
