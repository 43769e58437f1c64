"""CP generation: :mod:`~megacp.generate.llm` (the Python API, :class:`LLM`),
:mod:`~megacp.generate.session` (conversations on the persistent cache),
:mod:`~megacp.generate.sampling` (:class:`SamplingParams`, next-token sampling),
:mod:`~megacp.generate.loop` (the request loop, :class:`Generator`), :mod:`~megacp.generate.outputs`
(results, stop strings, text), :mod:`~megacp.generate.requests` (checks against the model) and
:mod:`~megacp.generate.cli` (``python -m megacp.generate``)."""

from megacp.generate.cli import main, parse_args
from megacp.generate.llm import LLM, StreamPiece
from megacp.generate.loop import GenerationResult, Generator
from megacp.generate.outputs import GenerationOutput
from megacp.generate.sampling import SamplingParams, sample
from megacp.generate.session import Session

__all__ = ["LLM", "GenerationOutput", "GenerationResult", "Generator", "SamplingParams", "Session", "StreamPiece",
           "main", "parse_args", "sample"]
