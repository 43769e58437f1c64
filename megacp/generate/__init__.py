"""CP generation: :mod:`~megacp.generate.llm` (the Python API, :class:`LLM`),
:mod:`~megacp.generate.session` (conversations on the persistent cache),
:mod:`~megacp.generate.sampling` (:class:`SamplingParams`, next-token sampling),
:mod:`~megacp.generate.engine` (the request engine: scheduler and output processor),
:mod:`~megacp.generate.worker` (its steps on a rank's cache), :mod:`~megacp.generate.graph` (the
CUDA-graph batch decoder), :mod:`~megacp.generate.loop` (the model runner, :class:`Generator`),
:mod:`~megacp.generate.outputs`
(results, stop strings, text), :mod:`~megacp.generate.requests` (checks against the model) and
:mod:`~megacp.generate.cli` (``python -m megacp.generate``)."""

from megacp.generate.cli import main, parse_args
from megacp.generate.llm import LLM, StreamPiece
from megacp.generate.loop import Generator
from megacp.generate.outputs import GenerationOutput, GenerationResult
from megacp.generate.sampling import SamplingParams, sample
from megacp.generate.session import Session

__all__ = ["LLM", "GenerationOutput", "GenerationResult", "Generator", "SamplingParams", "Session", "StreamPiece",
           "main", "parse_args", "sample"]
