"""megacp's command-line tools: benchmarks (``scripts.bench``), diagnostics (``scripts.diagnostics``),
the cost model (``scripts.perf_model``) and launchers (``scripts/launch``, shell). Run the Python
ones from the repository root as modules, e.g. ``python -m scripts.bench.prefill --help``."""
