"""GPU benchmarks of megacp against its peers, all built on :mod:`scripts.bench.harness`:
``prefill`` (ring prefill attention), ``decode`` (all-gather decode attention), ``generate``
(time to first token of a whole model)."""
