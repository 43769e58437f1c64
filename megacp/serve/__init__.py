"""An OpenAI-compatible server over megacp: ``python -m megacp.serve --model PATH``.

Rank 0 serves HTTP (:mod:`megacp.serve.app`) and runs the continuous-batching scheduler
(:mod:`megacp.serve.engine`); every step's work is broadcast to the other CP ranks
(:mod:`megacp.generate.worker`) before it runs, so all ranks run the same prefill and decode steps.
"""

from megacp.serve.cli import main

__all__ = ["main"]
