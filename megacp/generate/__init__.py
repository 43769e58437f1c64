"""CP generation: :mod:`~megacp.generate.sampling` (next-token sampling),
:mod:`~megacp.generate.loop` (the request loop, :class:`Generator`) and :mod:`~megacp.generate.cli`
(``python -m megacp.generate``)."""

from megacp.generate.cli import default_model_path, main, parse_args
from megacp.generate.loop import GenerationResult, Generator, _peak_memory_mb
from megacp.generate.sampling import SamplingParams, sample

__all__ = ["GenerationResult", "Generator", "SamplingParams", "default_model_path", "main", "parse_args", "sample",
           "_peak_memory_mb"]
