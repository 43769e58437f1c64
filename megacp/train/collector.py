"""Python's cyclic garbage collector during training, on a fixed schedule.

A full collection (generation 2) walks every object the collector tracks. Once torch, DeepSpeed and
transformers are imported and a model and its engine are built, that is millions of objects, and a
collection that the allocation counters trigger at some step stalls that step's host for tens of
milliseconds or more (and, with several ranks, every rank at the next collective).

:class:`GarbageCollection` (a context manager around the training loop):

* on entry, one full collection, then ``gc.freeze()``: everything alive at that point (the
  imported modules, the model, the engine, the optimizer) moves to the permanent generation, which
  later collections do not walk. Python's automatic collector stays on and only walks what the
  training loop creates.
* with ``every = N > 0`` (Megatron-LM's ``--manual-gc --manual-gc-interval N``): the automatic
  collector is off inside the block, and :meth:`GarbageCollection.after_step` runs a full
  collection after every ``N``-th step, at the point of the loop where it is called. Cyclic garbage
  then lives until the next such collection.
* on exit, the collector is as it was (automatic collection back on if it was, the frozen objects
  back in the oldest generation).
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """The collector's schedule over a training loop (see the module docstring).

    Args:
        every: a full collection after every ``every``-th step, the automatic collector off in
            between; 0: Python's automatic collector (walking only what was created after entry).
    """

    def __init__(self, every: int = 0) -> None:
        if every < 0:
            raise ValueError(f"every must be >= 0, got {every}")
        self.every = every
        self._was_enabled = True

    def __enter__(self) -> GarbageCollection:
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        if self.every:
            gc.disable()
        return self

    def after_step(self, step: int) -> None:
        """Call after optimizer step ``step`` (1-based) is done: a full collection when ``every``
        divides it."""
        if self.every and step % self.every == 0:
            gc.collect()

    def __exit__(self, *exc: object) -> None:
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
