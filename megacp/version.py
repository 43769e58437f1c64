"""megacp's version (what ``--version`` prints; setup.py's version, checked by a test)."""

__version__ = "0.1.0"
