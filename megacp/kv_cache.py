"""The CP-sharded incremental KV cache.

Each CP rank keeps, for every layer, a static preallocated buffer of ``max_requests`` slots ×
``capacity`` tokens (gpt-fast style: fixed shapes, CUDA-graph friendly) holding only **this rank's**
tokens of each request, in position order, plus their global positions. Placement follows
:mod:`megacp.placement`: prefill tokens stay where the load-balanced sharding put them
(also across chunked prefill and multi-turn continuation), a decoded token at position t lives only
on rank ``t mod N``. The host keeps, for every request, how many tokens *each* rank holds — every
rank can derive it from the request's history, so no communication is needed to plan a step.

A step is planned with :meth:`ShardedKVCache.plan`; the steps of :mod:`megacp.layers.step` write
each layer's new keys and values with :meth:`write` (or :meth:`write_rows` on the device) and read
with :meth:`kv` / :meth:`decode_kv`, and :meth:`commit` advances the bookkeeping once every layer
has written.

**FP8 storage** (``kv_cache_dtype="fp8_e4m3"``): keys and values are kept as ``torch.float8_e4m3fn``
with one fp32 scale per (layer, request slot, K or V, KV head), a power of two: a stored value
``x8`` stands for ``x8 * scale``. A request's scales are fixed at its first step (the step that
starts from an empty slot), layer by layer, from the largest magnitude of that step's keys
(values) of each head over **all** CP ranks, with :data:`FP8_HEADROOM` to spare: the smallest power
of two ``s`` with ``amax * FP8_HEADROOM <= 448 * s``. Later steps (chunks, decode, session turns)
reuse them; anything beyond ``448 * s`` is clamped to ``±448`` (never inf or NaN). Since every rank
derives the same scales, a KV block needs no scales on the wire and the FP8 result does not depend
on the CP size. Writes quantise (``x / s`` rounds once, to nearest, in the cast); reads
(:meth:`ShardedKVCache.kv`, :meth:`ShardedKVCache.decode_kv`, :meth:`ShardedKVCache.static_rows`)
dequantise the rows read to the compute dtype, exactly (a power-of-two scale loses nothing).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from megacp.placement import ShardPlan, held_after, shard_ranges

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value."""
FP8_HEADROOM = 4.0
"""A request's first step maps its largest key (value) of each head to between ``448 / 8`` and
``448 / 4``: later tokens up to 4-8x larger are stored without clamping."""
FP8_TILE_ROWS = 65536
"""Rows of an FP8 KV block a prefill dequantises at a time (:mod:`megacp.attention.fp8_kv`): a
chunk's transient is O(chunk + this), not O(cached length). 64K rows of the Llama-3.1-8B shape
(8 KV heads of 128) are 256 MiB of bf16 keys and values; a 16K-query chunk spends ~30 ms of
attention on them on an H100, against well under 1 ms to dequantise and merge them."""
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""``kv_cache_dtype`` names: ``"auto"`` (the compute dtype; also accepted: its name, e.g.
``"bfloat16"``), ``"fp8_e4m3"`` (``"fp8"`` is its alias, as in vLLM)."""

AmaxReduce = Callable[[Tensor], Tensor]
"""Elementwise max of a tensor over the CP ranks (every rank calls it with the same shape)."""


def kv_cache_format(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """The storage format of a cache of compute ``dtype`` asked for as ``kv_cache_dtype``:
    ``"auto"`` (keys and values in ``dtype``) or ``"fp8_e4m3"``.

    Raises:
        ValueError: a name that is not one of :data:`KV_CACHE_DTYPES` or ``dtype``'s own name.
    """
    own = str(dtype).removeprefix("torch.")
    if kv_cache_dtype in ("auto", own):
        return "auto"
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return "fp8_e4m3"
    if kv_cache_dtype in ("float32", "bfloat16", "float16"):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} differs from the model's dtype {own}: a cache in another "
                         "unquantised dtype is not implemented; use 'auto' or 'fp8_e4m3'")
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)} "
                     f"(or the model's dtype, {own})")


def fp8_scale(amax: Tensor) -> Tensor:
    """The power-of-two scale (fp32, same shape) that stores magnitudes up to ``amax`` (fp32, >= 0)
    with :data:`FP8_HEADROOM` to spare (an all-zero ``amax`` gets a tiny scale; zeros stay zeros)."""
    return torch.exp2(torch.ceil(torch.log2(amax.float().clamp_min(2.0 ** -100) * FP8_HEADROOM / FP8_MAX)))


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """``x / scale`` clamped to ``±448`` as ``float8_e4m3fn`` (``scale``: power-of-two fp32,
    broadcastable to ``x``; dividing by it is exact, the cast rounds once)."""
    return (x * scale.reciprocal().to(x.dtype)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``x * scale`` in ``dtype`` (``x``: ``float8_e4m3fn`` or its ``uint8`` view; ``scale``:
    power-of-two fp32 broadcastable to ``x``; exact in any float dtype of fp8's range)."""
    if x.dtype == torch.uint8:
        x = x.view(FP8)
    return x.to(dtype) * scale.to(dtype)


class CacheCapacityError(RuntimeError):
    """A request would not fit in the cache (raised before anything is written)."""


class ShardedKVCache:
    """This CP rank's shard of the KV cache of every layer.

    Args:
        num_layers, num_kv_heads, head_dim: model shape (KV heads of this TP rank).
        max_requests: concurrent request slots.
        capacity: tokens per request slot **on this rank** (a request of S tokens needs about
            S/N + 1 per rank with load balancing).
        cp_size, cp_rank: the CP group.
        load_balance: 2N-chunk prefill sharding (default) or contiguous chunks.
        dtype: the compute dtype (what writes take and reads return).
        kv_cache_dtype: the storage (:func:`kv_cache_format`): ``"auto"`` (``dtype``) or
            ``"fp8_e4m3"`` (see the module's docstring).

    Storage: ``k``/``v`` ``[num_layers, max_requests, capacity, num_kv_heads, head_dim]`` (``dtype``,
    or ``float8_e4m3fn``), ``scales`` ``[num_layers, max_requests, 2, num_kv_heads]`` fp32 (K then V;
    FP8 only, else ``None``) and ``positions`` ``[max_requests, capacity]`` (int64, -1 where empty)
    on ``device``.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_requests: int,
        capacity: int,
        cp_size: int = 1,
        cp_rank: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        load_balance: bool = True,
        kv_cache_dtype: str = "auto",
    ) -> None:
        for name, val in (("num_layers", num_layers), ("max_requests", max_requests), ("capacity", capacity), ("cp_size", cp_size)):
            if val < 1:
                raise ValueError(f"ShardedKVCache {name} must be >= 1, got {val}")
        self.num_layers, self.capacity, self.max_requests = num_layers, capacity, max_requests
        self.cp_size, self.cp_rank, self.load_balance = cp_size, cp_rank, load_balance
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_format(kv_cache_dtype, dtype)
        self.quantized = self.kv_cache_dtype == "fp8_e4m3"
        shape = (num_layers, max_requests, capacity, num_kv_heads, head_dim)
        store = FP8 if self.quantized else dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.scales = (torch.ones((num_layers, max_requests, 2, num_kv_heads), dtype=torch.float32, device=device)
                       if self.quantized else None)
        self.positions = torch.full((max_requests, capacity), -1, dtype=torch.long, device=device)
        self.fp8_tile_rows = FP8_TILE_ROWS
        """Rows of a KV block a prefill over this (FP8) cache dequantises at a time."""
        self._free = list(range(max_requests - 1, -1, -1))
        self._history: dict[int, list[int]] = {}
        self._held: dict[int, list[int]] = {}  # slot -> tokens held by each CP rank

    # ------------------------------------------------------------------ slots
    def allocate(self) -> int:
        """A free request slot (raises :class:`CacheCapacityError` when all are in use)."""
        if not self._free:
            raise CacheCapacityError(f"all {self.max_requests} KV cache request slots are in use; free one or raise max_requests")
        slot = self._free.pop()
        self._history[slot] = [0]
        self._held[slot] = [0] * self.cp_size
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot`` for reuse (its contents are overwritten by the next request)."""
        self._check_slot(slot)
        del self._history[slot], self._held[slot]
        self.positions[slot] = -1
        self._free.append(slot)

    def _check_slot(self, slot: int) -> None:
        if slot not in self._history:
            raise KeyError(f"KV cache slot {slot} is not allocated")

    def history(self, slot: int) -> list[int]:
        """Computed-token counts after each step of the request in ``slot`` (starts with 0)."""
        self._check_slot(slot)
        return list(self._history[slot])

    def length(self, slot: int) -> int:
        """Tokens of the request computed so far (all ranks together)."""
        self._check_slot(slot)
        return self._history[slot][-1]

    def local_length(self, slot: int, rank: int | None = None) -> int:
        """Tokens of the request held by ``rank`` (default: this rank)."""
        self._check_slot(slot)
        return self._held[slot][self.cp_rank if rank is None else rank]

    def check_room(self, slot: int, steps: Sequence[int], spare: int = 0) -> None:
        """Raise :class:`CacheCapacityError` unless the request in ``slot`` can take ``steps`` (its
        new-token counts, step by step: prefill chunks, then 1 per decode step) on every CP rank
        with ``spare`` rows left over on each (a static decode step writes one row past a rank's
        tokens when it does not own the step's token)."""
        self._check_slot(slot)
        pos = self.length(slot) + sum(steps)
        held = held_after(self._held[slot], self.length(slot), steps, self.cp_size, load_balance=self.load_balance)
        worst = max(range(self.cp_size), key=held.__getitem__)
        if held[worst] + spare > self.capacity:
            raise CacheCapacityError(
                f"{pos} tokens in all would need {held[worst] + spare} KV cache rows on CP rank {worst}, which holds "
                f"{self.capacity} per request; raise the cache capacity or the CP size"
            )

    # ------------------------------------------------------------------ steps
    def plan(self, slots: Sequence[int], new_tokens: Sequence[int]) -> ShardPlan:
        """Plan a step that adds ``new_tokens[i]`` tokens to the request in ``slots[i]``.

        Checks capacity on every rank first: nothing is written when a request would not fit.
        """
        if len(set(slots)) != len(slots):
            raise ValueError(f"a step lists a slot twice: {list(slots)}")
        for s in slots:
            self._check_slot(s)
        plan = ShardPlan(
            [self.length(s) for s in slots], new_tokens, self.cp_size, self.cp_rank,
            prefix_counts=[[self._held[s][j] for s in slots] for j in range(self.cp_size)],
            load_balance=self.load_balance, histories=[self._history[s] for s in slots],
        )
        for j in range(self.cp_size):
            for i, s in enumerate(slots):
                need = self._held[s][j] + sum(b - a for a, b in plan.ranges[j][i])
                if need > self.capacity:
                    raise CacheCapacityError(
                        f"request in slot {s} needs {need} tokens on CP rank {j} but the KV cache holds "
                        f"{self.capacity} per request per rank ({self.length(s) + plan.new[i]} tokens in all); "
                        "raise the cache capacity or the CP size"
                    )
        return plan

    def write(self, layer: int, slots: Sequence[int], plan: ShardPlan, k: Tensor, v: Tensor,
              amax_reduce: AmaxReduce | None = None) -> tuple[Tensor, Tensor]:
        """Store this rank's new keys/values of a planned step for ``layer``.

        Args:
            k, v: ``[plan.num_local(), Hkv, D]`` in ``plan.q_layout(rank)`` order, in :attr:`dtype`.
            amax_reduce: FP8 only, needed under CP > 1 when a request makes its first step (it fixes
                the request's scales from the step's largest magnitudes on all ranks: every rank
                calls it, with ``[requests, 2, Hkv]`` fp32).

        Returns:
            ``(k, v)`` as stored (``float8_e4m3fn`` in an FP8 cache, else the inputs).
        """
        want = (plan.num_local(), *self.k.shape[3:])
        if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(
                f"KV cache write expects k and v of shape {want} and dtype {self.dtype}; got "
                f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
        lays = plan.q_layout(self.cp_rank)
        if self.quantized:
            k, v = self._quantize(layer, slots, plan, k, v, amax_reduce)
        for s, lay in zip(slots, lays):
            n = lay.num_new
            if n:
                start = self._held[s][self.cp_rank]
                self.k[layer, s, start : start + n] = k[lay.offset : lay.offset + n]
                self.v[layer, s, start : start + n] = v[lay.offset : lay.offset + n]
        return k, v

    def _quantize(self, layer: int, slots: Sequence[int], plan: ShardPlan, k: Tensor, v: Tensor,
                  amax_reduce: AmaxReduce | None) -> tuple[Tensor, Tensor]:
        """``k``, ``v`` of :meth:`write` in FP8, each request's rows with its slot's scales (fixed
        first for the requests that make their first step)."""
        assert self.scales is not None  # an FP8 cache
        lays = plan.q_layout(self.cp_rank)
        first = [i for i in range(plan.num_requests) if plan.cached[i] == 0]
        if first:
            if amax_reduce is None and self.cp_size > 1:
                raise ValueError("an FP8 KV cache under CP > 1 fixes a request's scales over all CP ranks: "
                                 "its first step's write needs amax_reduce")
            amax = torch.zeros((len(first), 2, self.k.shape[3]), dtype=torch.float32, device=k.device)
            for j, i in enumerate(first):
                a, b = lays[i].offset, lays[i].offset + lays[i].num_new
                if b > a:
                    amax[j, 0] = k[a:b].abs().amax(dim=(0, 2)).float()
                    amax[j, 1] = v[a:b].abs().amax(dim=(0, 2)).float()
            if amax_reduce is not None:
                amax = amax_reduce(amax)
            self.scales[layer, [slots[i] for i in first]] = fp8_scale(amax)
        k8, v8 = torch.empty_like(k, dtype=FP8), torch.empty_like(v, dtype=FP8)
        for s, lay in zip(slots, lays):
            a, b = lay.offset, lay.offset + lay.num_new
            if b > a:
                k8[a:b] = quantize_fp8(k[a:b], self.scales[layer, s, 0, :, None])
                v8[a:b] = quantize_fp8(v[a:b], self.scales[layer, s, 1, :, None])
        return k8, v8

    def stored_kv(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """Views ``[length, Hkv, D]`` of the first ``length`` tokens this rank holds of ``slot``,
        as stored (``float8_e4m3fn`` in an FP8 cache)."""
        return self.k[layer, slot, :length], self.v[layer, slot, :length]

    def step_scales(self, layer: int, slots: Sequence[int]) -> Tensor:
        """``[len(slots), 2, Hkv]`` fp32: the FP8 scales of ``layer`` for the requests in ``slots``
        (K then V), the same on every CP rank."""
        if self.scales is None:
            raise ValueError("a KV cache that is not FP8 has no scales")
        return self.scales[layer, list(slots)]

    def kv(self, layer: int, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """``[length, Hkv, D]`` in :attr:`dtype`: the first ``length`` tokens this rank holds of
        ``slot`` (views; dequantised copies in an FP8 cache)."""
        k, v = self.stored_kv(layer, slot, length)
        if self.scales is None:
            return k, v
        scale = self.scales[layer, slot, :, :, None]  # [2, Hkv, 1]
        return dequantize_fp8(k, scale[0], self.dtype), dequantize_fp8(v, scale[1], self.dtype)

    def decode_kv(self, layer: int, slots: Sequence[int], lengths: Sequence[int]) -> tuple[Tensor, Tensor] | list[tuple[Tensor, Tensor]]:
        """What a decode step attends over for ``layer``: the first ``lengths[i]`` tokens this rank
        holds of ``slots[i]``, in :attr:`dtype`. Consecutive slots of equal lengths come as one pair
        ``[B, length, Hkv, D]`` (views, no copy; one dequantised copy in an FP8 cache), others as a
        list of :meth:`kv` pairs."""
        s0 = slots[0]
        if len(set(lengths)) == 1 and list(slots) == list(range(s0, s0 + len(slots))):
            end = s0 + len(slots)
            k, v = self.k[layer, s0:end, : lengths[0]], self.v[layer, s0:end, : lengths[0]]
            if self.scales is None:
                return k, v
            scale = self.scales[layer, s0:end, :, None, :, None]  # [B, 2, 1, Hkv, 1]
            return dequantize_fp8(k, scale[:, 0], self.dtype), dequantize_fp8(v, scale[:, 1], self.dtype)
        return [self.kv(layer, s, n) for s, n in zip(slots, lengths)]

    def commit(self, slots: Sequence[int], plan: ShardPlan) -> None:
        """Advance the bookkeeping after every layer has written the step."""
        local = plan.local_positions().to(self.positions.device)
        for s, i, lay in zip(slots, range(plan.num_requests), plan.q_layout(self.cp_rank)):
            start = self._held[s][self.cp_rank]
            self.positions[s, start : start + lay.num_new] = local[lay.offset : lay.offset + lay.num_new]
            for j in range(self.cp_size):
                self._held[s][j] += sum(b - a for a, b in plan.ranges[j][i])
            self._history[s].append(self._history[s][-1] + plan.new[i])

    # ------------------------------------------------------------------ static decode (device-side)
    def flat_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """Views ``[max_requests * capacity, Hkv, D]`` of ``layer``'s keys and values as stored:
        slot ``s``'s row ``j`` is row ``s * capacity + j`` (a static decode step indexes rows on the
        device)."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write_rows(self, layer: int, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Write ``k``/``v`` ``[B, Hkv, D]`` (:attr:`dtype`) at device-held ``rows [B]`` (int64) of
        :meth:`flat_kv`, quantised with each row's slot's scales in an FP8 cache (fixed by the
        request's first step, a prefill) (no host synchronisation: a CUDA graph replays it)."""
        kf, vf = self.flat_kv(layer)
        if self.scales is not None:
            scale = self.scales[layer].index_select(0, torch.div(rows, self.capacity, rounding_mode="floor"))
            k = quantize_fp8(k, scale[:, 0, :, None]).view(torch.uint8)
            v = quantize_fp8(v, scale[:, 1, :, None]).view(torch.uint8)
            kf, vf = kf.view(torch.uint8), vf.view(torch.uint8)  # index_copy_ has no float8 kernel
        kf.index_copy_(0, rows, k)
        vf.index_copy_(0, rows, v)

    def stored_rows(self, layer: int, starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """An FP8 cache's rows as stored, for a decode kernel that reads them so
        (:mod:`~megacp.attention.fp8_decode_kernel`): ``(k, v, scales)``, the :meth:`flat_kv` views
        and the ``[B, 2, Hkv]`` fp32 scales of the requests whose first rows are ``starts [B]``
        (int64). No host synchronisation."""
        if self.scales is None:
            raise ValueError("a KV cache that is not FP8 has no scales")
        kf, vf = self.flat_kv(layer)
        return kf, vf, self.scales[layer].index_select(0, torch.div(starts, self.capacity, rounding_mode="floor"))

    def static_rows(self, layer: int, starts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What a static decode step attends over for ``layer``, for the requests whose first rows
        of :meth:`flat_kv` are ``starts [B]`` (int64): ``(k, v, starts)``, where request ``b``'s rows
        are ``k[starts[b] : starts[b] + capacity]`` in :attr:`dtype`. The flat views themselves, or
        in an FP8 cache each request's ``capacity`` rows gathered and dequantised (``[B * capacity,
        Hkv, D]``, ``starts = b * capacity``). No host synchronisation."""
        kf, vf = self.flat_kv(layer)
        if self.scales is None:
            return kf, vf, starts
        b, c = starts.shape[0], self.capacity
        rows = (starts.unsqueeze(1) + torch.arange(c, device=starts.device)).flatten()
        scale = self.scales[layer].index_select(0, torch.div(starts, c, rounding_mode="floor"))[:, :, None, :, None]
        k, v = (dequantize_fp8(t.view(torch.uint8).index_select(0, rows).view(b, c, *t.shape[1:]), scale[:, i], self.dtype)
                for i, t in enumerate((kf, vf)))  # scale[:, i]: [B, 1, Hkv, 1]
        return k.flatten(0, 1), v.flatten(0, 1), torch.arange(b, dtype=starts.dtype, device=starts.device) * c

    def decode_state(self, slots: Sequence[int], device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
        """Device tensors a static decode step starts from, for the requests in ``slots``:
        ``positions [B]`` int64 (each request's next position = its length), ``held [B]`` int32
        (tokens this rank holds) and ``starts [B]`` int64 (row of each slot's first token in
        :meth:`flat_kv`)."""
        for s in slots:
            self._check_slot(s)
        return (torch.tensor([self.length(s) for s in slots], dtype=torch.long, device=device),
                torch.tensor([self.local_length(s) for s in slots], dtype=torch.int32, device=device),
                torch.tensor([s * self.capacity for s in slots], dtype=torch.long, device=device))

    def advance_decoded(self, slot: int, count: int) -> None:
        """Host bookkeeping of ``count`` decode steps whose keys and values a static decode step
        already wrote on the device (one token per step, placed by :func:`~megacp.placement.shard_ranges`)."""
        self._check_slot(slot)
        held, pos, mine = self._held[slot], self.length(slot), []
        for t in range(pos, pos + count):
            for j in range(self.cp_size):
                ranges = shard_ranges(t, 1, self.cp_size, j, load_balance=self.load_balance)
                held[j] += len(ranges)
                if ranges and j == self.cp_rank:
                    mine.append(t)
            self._history[slot].append(t + 1)
        start = held[self.cp_rank] - len(mine)
        self.positions[slot, start : start + len(mine)] = torch.tensor(mine, dtype=torch.long)

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` tokens (positions ``< length``) of the request in ``slot``:
        every rank drops its rows of later positions (its rows are in position order, so they are a
        tail) and the next step continues at position ``length``. A no-op at the slot's length.

        Raises:
            ValueError: ``length`` is negative or more than the slot holds.
        """
        self._check_slot(slot)
        history = self._history[slot]
        if not 0 <= length <= history[-1]:
            raise ValueError(f"cannot truncate KV cache slot {slot} of {history[-1]} tokens to {length}")
        if length == history[-1]:
            return
        held = [0] * self.cp_size
        for start, end in zip(history, history[1:]):  # replay the placement of every step, clipped at length
            if start >= length:
                break
            for j in range(self.cp_size):
                held[j] += sum(min(b, length) - a for a, b in
                               shard_ranges(start, end - start, self.cp_size, j, load_balance=self.load_balance) if a < length)
        self._history[slot] = [h for h in history if h < length] + [length]
        self._held[slot] = held
        self.positions[slot, held[self.cp_rank]:] = -1

    # ------------------------------------------------------------------ rollback of a failed step
    def snapshot(self, slot: int) -> tuple[list[int], list[int], Tensor]:
        """The bookkeeping of ``slot`` (its lengths history, tokens held per rank, positions row):
        what :meth:`restore` puts back after a turn that failed part-way. Keys and values past the
        restored lengths are never read again, so they need no copy."""
        self._check_slot(slot)
        return list(self._history[slot]), list(self._held[slot]), self.positions[slot].clone()

    def restore(self, slot: int, state: tuple[list[int], list[int], Tensor]) -> None:
        """Put back ``slot``'s bookkeeping as :meth:`snapshot` returned it."""
        self._check_slot(slot)
        history, held, positions = state
        self._history[slot], self._held[slot] = list(history), list(held)
        self.positions[slot].copy_(positions)
