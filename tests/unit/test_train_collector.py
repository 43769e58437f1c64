"""``megacp.train.collector.GarbageCollection``: what set-up built is frozen out of the collections,
cyclic garbage of the training loop is collected by Python's automatic collector (``every`` 0) or
only after every ``every``-th step, and the collector is restored on exit."""

from __future__ import annotations

import gc
import weakref

import pytest

from megacp.train.collector import GarbageCollection


class _Node:
    """An object that can form a reference cycle."""

    other: object = None


def _cycle() -> weakref.ref:
    """A reference cycle dropped at once (only the cyclic collector frees it); a weak reference to it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def _allocate() -> list[list[int]]:
    """Enough live container objects to trip the automatic collector's generation-0 threshold."""
    return [[] for _ in range(20 * gc.get_threshold()[0])]


def _walked(obj: object) -> bool:
    """Whether a collection walks ``obj`` (it is in generation 0, 1 or 2, not frozen)."""
    return any(o is obj for o in gc.get_objects())


def test_manual_schedule_collects_after_every_nth_step_only() -> None:
    assert gc.isenabled() and gc.get_freeze_count() == 0
    setup = _Node()
    with GarbageCollection(every=3) as collector:
        assert not gc.isenabled() and not _walked(setup)
        garbage = _cycle()
        kept = _allocate()  # no automatic collection while training
        for step in (1, 2):
            collector.after_step(step)
        assert garbage() is not None
        collector.after_step(3)
        assert garbage() is None
        assert not _walked(setup)  # still frozen: a full collection leaves it alone
    assert gc.isenabled() and gc.get_freeze_count() == 0 and _walked(setup) and kept


def test_automatic_schedule_collects_what_training_drops() -> None:
    setup = _Node()
    with GarbageCollection() as collector:
        assert gc.isenabled() and not _walked(setup)
        garbage = _cycle()
        collector.after_step(100)  # every 0: the schedule itself never collects
        assert garbage() is not None
        kept = _allocate()
        assert garbage() is None  # Python's automatic collector did
    assert gc.get_freeze_count() == 0 and kept


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        with GarbageCollection(every=2):
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="every must be >= 0"):
        GarbageCollection(-1)
