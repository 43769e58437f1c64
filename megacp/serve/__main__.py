import sys

from megacp.serve.cli import main

sys.exit(main())
