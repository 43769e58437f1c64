"""The server's step-time summary (:func:`megacp.serve.engine.step_summary`) on known times."""

from __future__ import annotations

from megacp.serve.engine import step_summary


def test_step_summary_splits_decode_and_prefill_steps() -> None:
    times = [(0.001 * (i + 1), False) for i in range(100)] + [(0.5, True), (0.25, True)]
    out = step_summary(times)
    assert out["decode"] == {"steps": 100, "p50": 51.0, "p99": 100.0, "max": 100.0}
    assert out["prefill"] == {"steps": 2, "p50": 500.0, "p99": 500.0, "max": 500.0}
    assert step_summary([(0.002, False)]) == {"decode": {"steps": 1, "p50": 2.0, "p99": 2.0, "max": 2.0}}
    assert step_summary([]) == {}
