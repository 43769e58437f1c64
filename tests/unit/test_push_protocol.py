"""The copy-engine ring's protocol (:func:`megacp.parallel.peer.push_schedule`) simulated for N = 2..8
ranks over several rotations: every step hands out the right rank's block of the right rotation, no
slot is overwritten before its reader released it, and nothing deadlocks — with each rank's window,
compute and consumer streams independent (in random interleavings) and with all of a rank's streams
sharing one hardware queue in the host's order (the strictest case). The GPU test
(``tests/gpu/test_gpu_ring.py``) runs the real transport, but only at N = 2."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from megacp.parallel.peer import push_schedule


@dataclass
class Op:
    """A simulated stream operation of one rank."""

    stream: str  # "main", "aux" (the second compute stream, when the consumer is not main) or "side"
    kind: str  # push_schedule kinds with "hand_out" replaced by "compute", plus "wait_stream"
    step: int = 0
    slot: int = 0
    peer: int = 0
    value: int = 0
    rotation: int = 0
    on: str = ""  # wait_stream: the stream waited for ...
    count: int = 0  # ... until it has executed this many operations


@dataclass
class Sim:
    n: int
    ready: list[list[int]] = field(default_factory=list)  # ready[t][k]: flag in t's window
    free: dict[tuple[int, int, int], int] = field(default_factory=dict)  # (window, user, slot) -> flag
    content: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (t, k) -> (rotation, source)
    fills: dict[tuple[int, int], int] = field(default_factory=dict)
    reads: dict[tuple[int, int], int] = field(default_factory=dict)
    computed: list[list[tuple[int, int]]] = field(default_factory=list)
    done: dict[tuple[int, str], int] = field(default_factory=dict)

    def runnable(self, r: int, op: Op) -> bool:
        if op.kind == "wait_free":
            return self.free.get((r, op.peer, op.slot), 0) >= op.value
        if op.kind == "wait_ready":
            return self.ready[r][op.slot] >= op.value
        if op.kind == "wait_stream":
            return self.done.get((r, op.on), 0) >= op.count
        return True

    def run(self, r: int, op: Op) -> None:
        if op.kind == "push":
            key = (op.peer, op.slot)
            assert self.fills.get(key, 0) == self.reads.get(key, 0), f"rank {r} overwrote {key} before it was read"
            self.content[key] = (op.rotation, r)
            self.fills[key] = self.fills.get(key, 0) + 1
        elif op.kind == "ready":
            assert op.value > self.ready[op.peer][op.slot]
            self.ready[op.peer][op.slot] = op.value
        elif op.kind == "compute":
            key = (r, op.slot)
            want = (op.rotation, (r - op.step) % self.n)
            assert self.content.get(key) == want, f"rank {r} step {op.step}: slot holds {self.content.get(key)}, want {want}"
            self.reads[key] = self.reads.get(key, 0) + 1
            self.computed[r].append(want)
        elif op.kind == "release":
            for p in range(self.n):
                if p != r:
                    self.free[(p, r, op.slot)] = op.value
        self.done[(r, op.stream)] = self.done.get((r, op.stream), 0) + 1


def host_order(n: int, r: int, rotations: int, consumer: str) -> list[Op]:
    """Rank ``r``'s operations in the order its host queues them (as ``Ring._rotate_push`` inside
    ``ring_pass_kv``: the consumer stream first waits for the main stream, step 0 on main, then the
    schedule; at the end main waits for the pushes and the consumer)."""
    ops: list[Op] = []
    count = {"main": 0, "aux": 0, "side": 0}

    def add(op: Op) -> None:
        ops.append(op)
        count[op.stream] += 1

    uses = [0, 0]
    for e in range(rotations):
        if consumer != "main":
            add(Op("aux", "wait_stream", on="main", count=count["main"]))
        add(Op("side", "wait_stream", on="main", count=count["main"]))  # the block is produced
        add(Op("main", "compute0", rotation=e))
        schedule, uses = push_schedule(n, r, uses)
        for p in schedule:
            side = p.kind in ("wait_free", "push", "ready")
            kind = "compute" if p.kind == "hand_out" else p.kind
            add(Op("side" if side else consumer, kind, p.step, p.slot, p.peer, p.value, rotation=e))
        add(Op("main", "wait_stream", on="side", count=count["side"]))
        if consumer != "main":
            add(Op("main", "wait_stream", on="aux", count=count["aux"]))
    return ops


def simulate(n: int, rotations: int, consumer: str, shared_queue: bool, seed: int) -> Sim:
    sim = Sim(n, ready=[[0, 0] for _ in range(n)], computed=[[] for _ in range(n)])
    queues: dict[tuple[int, str], list[Op]] = {}
    for r in range(n):
        for op in host_order(n, r, rotations, consumer):
            queues.setdefault((r, "all" if shared_queue else op.stream), []).append(op)
    rng = random.Random(seed)
    while any(queues.values()):
        heads = [(r, q) for (r, name), q in queues.items() if q and sim.runnable(r, q[0])]
        if not heads:
            stuck = {f"rank {r} {name}": q[0].kind for (r, name), q in queues.items() if q}
            raise AssertionError(f"deadlock: {stuck}")
        r, q = rng.choice(heads)
        sim.run(r, q.pop(0))
    return sim


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("consumer", ["main", "aux"])
@pytest.mark.parametrize("shared_queue", [False, True])
def test_push_protocol_delivers_every_block_without_deadlock(n: int, consumer: str, shared_queue: bool) -> None:
    rotations = 4
    for seed in range(8 if not shared_queue else 2):
        sim = simulate(n, rotations, consumer, shared_queue, seed)
        for r in range(n):
            assert sim.computed[r] == [(e, (r - s) % n) for e in range(rotations) for s in range(1, n)]


def test_push_schedule_counts_uses_across_rotations() -> None:
    ops, uses = push_schedule(4, 1, [3, 1])
    assert uses == [5, 2]  # steps 1, 3 use slot 0, step 2 slot 1
    pushes = [(o.step, o.peer, o.slot) for o in ops if o.kind == "push"]
    assert pushes == [(1, 2, 0), (2, 3, 1), (3, 0, 0)]
    waits = [(o.step, o.value) for o in ops if o.kind == "wait_free"]
    assert waits == [(1, 3), (2, 1), (3, 4)]  # a push waits for the slot's previous use to be released
    assert [o.kind for o in ops[:6]] == ["wait_free", "push", "ready"] * 2  # two steps ahead
    assert push_schedule(1, 0, [0, 0]) == ([], [0, 0])
