"""Peak bytes of the tensors a piece of code allocates, on any device (CPU tests of memory claims).

:class:`TensorMemory` is a ``TorchDispatchMode``: every storage an ATen op returns is counted once
(its ``nbytes``) until the storage is freed (a weak-reference finalizer on the storage object, which
torch keeps unique per storage), so the live total is that of the tensors made inside the block, the
peak is its maximum, and ``largest`` names the biggest allocations. Allocations inside a kernel
(scratch a CPU kernel frees before returning) are not seen; views, in-place results and tensors
made before the block are not counted again.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemory(TorchDispatchMode):
    """Live and peak bytes of the storages ops allocate inside ``with TensorMemory() as mem:``.

    Attributes:
        live: bytes of the counted storages still alive.
        peak: the largest ``live`` seen.
        largest: ``(bytes, op name, shape)`` of the ``keep`` largest allocations, largest first.
    """

    def __init__(self, keep: int = 8) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.keep = keep
        self.largest: list[tuple[int, str, tuple[int, ...]]] = []
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen.add(key)
            weakref.finalize(storage, self._free, key, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.largest = sorted([*self.largest, (nbytes, str(func.overloadpacket.__name__), tuple(t.shape))],
                                  reverse=True)[: self.keep]
        return out
