"""``python -m megacp.generate``: see :mod:`megacp.generate.cli`."""

import sys

from megacp.generate.cli import main

sys.exit(main())
