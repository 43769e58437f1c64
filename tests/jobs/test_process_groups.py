"""Real gloo process groups: every group carries exactly the ranks the layout says, mpu getters agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megacp
from megacp import ConfigError, ParallelLayout, ParallelState
from megacp.parallel.layout import GROUP_KINDS
from megacp.parallel.mpu import DeepSpeedMPU
from tests.helpers.distributed import free_port, run_distributed
from tests.helpers.timeouts import HANG_GUARD_S

# (world size, megacp config dict or a layout to build directly) -> expected layout
MESHES = [
    (2, None, ParallelLayout(cp=2)),
    (2, {"context_parallel": {"size": 1}}, ParallelLayout(dp=2)),
    (4, {"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2}}, ParallelLayout(cp=2, tp=2)),
    (4, {"context_parallel": {"size": 2}}, ParallelLayout(dp=2, cp=2)),
    (4, ParallelLayout(pp=2, cp=2), ParallelLayout(pp=2, cp=2)),  # no config has pipeline stages
    (4, None, ParallelLayout(cp=4)),
    (4, {"tensor_model_parallel": {"size": 2}, "expert_model_parallel": {"include_cp": True}},
     ParallelLayout(dp=2, tp=2, ep_includes_cp=True)),
    (8, {"context_parallel": {"size": 2}, "external_data_parallel": {"size": 2}}, ParallelLayout(cp=2, dp=2, ext_dp=2)),
]


def _collectives(rank: int, world_size: int, config: dict | ParallelLayout | None) -> dict:
    """Per kind: the ranks an all_gather over the group returns, an all_reduce sum, the getters."""
    state = ParallelState.build(config) if isinstance(config, ParallelLayout) else megacp.initialize(config)
    assert isinstance(state, ParallelState) and state.rank == rank
    out: dict = {"layout": state.layout, "device": str(state.device), "backend": state.backend}
    for kind in GROUP_KINDS:
        group = state.group(kind)
        size = dist.get_world_size(group)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(gathered, torch.tensor([rank]), group=group)
        total = torch.tensor([rank + 1], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        out[kind] = {
            "gathered": [int(t) for t in gathered],
            "sum": int(total),
            "ranks": list(state.ranks(kind)),
            "size": state.size(kind),
            "rank_in": state.rank_in(kind),
            "dist_rank": dist.get_rank(group),
            "is_world": group is dist.group.WORLD,
        }
    return out


@pytest.mark.parametrize("world,config,layout", MESHES, ids=lambda v: str(v) if isinstance(v, ParallelLayout) else "")
def test_groups_carry_exact_ranks(world: int, config: dict | None, layout: ParallelLayout) -> None:
    results = run_distributed(_collectives, world, config)
    for rank, out in enumerate(results):
        assert out["layout"] == layout
        assert out["device"] == "cpu" and out["backend"] == "gloo"
        for kind in GROUP_KINDS:
            expected = layout.group_of(kind, rank)
            got = out[kind]
            assert got["gathered"] == expected, (rank, kind)
            assert got["ranks"] == expected and got["size"] == len(expected)
            assert got["sum"] == sum(r + 1 for r in expected)
            assert got["rank_in"] == got["dist_rank"] == expected.index(rank)
            assert got["is_world"] == (len(expected) == world)


def test_cp_ring_pinned_on_cp2_tp2() -> None:
    """cp2 x tp2 on 4 ranks: CP rings are {0,2} and {1,3}, TP pairs {0,1} and {2,3}."""
    results = run_distributed(_collectives, 4, {"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2}})
    assert [out["cp"]["gathered"] for out in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [out["tp"]["gathered"] for out in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [out["dp"]["size"] for out in results] == [1, 1, 1, 1]
    assert [out["dp_cp"]["gathered"] for out in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _initialize_variants(rank: int, world_size: int, config_path: str) -> dict:
    """initialize() from a file path; reuse of the initialised group; config/world mismatch errors."""
    state = megacp.initialize(config_path)
    again = megacp.initialize(megacp.load_config(config_path))
    errors = {}
    for name, bad in (("cp3", {"context_parallel": {"size": 3}}), ("ep", {"expert_model_parallel": {"size": 3}})):
        try:
            megacp.initialize(bad)
        except ConfigError as err:
            errors[name] = str(err)
    try:
        megacp.initialize(None, backend="nccl")
    except ValueError as err:
        errors["backend"] = str(err)
    try:
        ParallelState.build(ParallelLayout(cp=8))
    except ConfigError as err:
        errors["build"] = str(err)
    return {
        "prefill": state.config.context_parallel.prefill,
        "layout": state.layout,
        "same": again.layout == state.layout and again.ranks("cp") == state.ranks("cp"),
        "coords": state.coords,
        "world": state.world_size,
        "errors": errors,
    }


def test_initialize_from_path_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                "context_parallel": {"size": 2, "prefill": "pass_q"}}))
    results = run_distributed(_initialize_variants, 4, str(path))
    for rank, out in enumerate(results):
        assert out["prefill"] == "pass_q" and out["same"]
        assert out["layout"] == ParallelLayout(dp=2, cp=2) and out["world"] == 4
        assert out["coords"] == {"ext_dp": 0, "dp": rank // 2, "pp": 0, "cp": rank % 2, "tp": 0}
        assert out["errors"] == {
            "cp3": "context_parallel.size x tensor_model_parallel.size x pipeline_model_parallel.size "
                   "= 3 x 1 x 1 = 3 does not divide the world size 4; allowed: sizes whose product divides 4",
            "ep": "expert_model_parallel.size: 3 does not match the expert-parallel group of "
                  "ext_dp1 x dp4 x pp1 x cp1 x tp1 = 4 ranks (dp x tp = 4 ranks); allowed value: 4",
            "backend": "torch.distributed is already initialised with backend 'gloo', not 'nccl'",
            "build": "layout ext_dp1 x dp1 x pp1 x cp8 x tp1 = 8 ranks needs 8 ranks, but the world size is 4",
        }


def _mpu_getters(rank: int, world_size: int, config: dict) -> dict:
    mpu = DeepSpeedMPU(megacp.initialize(config))
    out = {}
    for prefix in ("sequence_parallel", "sequence_data_parallel", "data_parallel", "model_parallel",
                   "tensor_model_parallel", "slice_parallel", "pipeline_model_parallel", "pipe_parallel"):
        group = getattr(mpu, f"get_{prefix}_group")()
        members = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, torch.tensor([rank]), group=group)
        out[prefix] = (
            getattr(mpu, f"get_{prefix}_world_size")(),
            getattr(mpu, f"get_{prefix}_rank")(),
            [int(m) for m in members],
        )
    out["dp_ranks"] = mpu.get_data_parallel_group_ranks()
    out["tp_src"] = mpu.get_tensor_model_parallel_src_rank()
    out["no_megatron_sp_hook"] = not hasattr(mpu, "initialize_sequence_parallel")
    return out


def test_mpu_getters_dp2_cp2() -> None:
    results = run_distributed(_mpu_getters, 4, {"context_parallel": {"size": 2}})
    for rank, out in enumerate(results):
        cp_index, dp_index = rank % 2, rank // 2
        assert out["sequence_parallel"] == (2, cp_index, [2 * dp_index, 2 * dp_index + 1])
        assert out["sequence_data_parallel"] == (4, rank, [0, 1, 2, 3])
        assert out["data_parallel"] == (2, dp_index, [cp_index, cp_index + 2])
        assert out["model_parallel"] == out["tensor_model_parallel"] == (1, 0, [rank])
        assert out["slice_parallel"] == out["tensor_model_parallel"]
        assert out["pipeline_model_parallel"] == out["pipe_parallel"] == (1, 0, [rank])
        assert out["dp_ranks"] == [cp_index, cp_index + 2]
        assert out["tp_src"] == rank and out["no_megatron_sp_hook"]


def test_mpu_getters_cp2_tp2() -> None:
    config = {"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2}}
    results = run_distributed(_mpu_getters, 4, config)
    for rank, out in enumerate(results):
        tp_index, cp_index = rank % 2, rank // 2
        assert out["sequence_parallel"] == (2, cp_index, [tp_index, tp_index + 2])
        assert out["sequence_data_parallel"] == out["sequence_parallel"]
        assert out["data_parallel"] == (1, 0, [rank])
        assert out["tensor_model_parallel"] == (2, tp_index, [2 * cp_index, 2 * cp_index + 1])
        assert out["model_parallel"] == out["tensor_model_parallel"]
        assert out["tp_src"] == 2 * cp_index


def _single_process(rank: int, world_size: int) -> dict:
    """initialize() in a process with no launcher environment: a world of one on a free port."""
    import os

    dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    state = megacp.initialize()
    value = torch.tensor([5.0])
    dist.all_reduce(value, group=state.group("cp"))
    return {"world": dist.get_world_size(), "layout": state.layout, "value": float(value),
            "all_world": all(state.group(kind) is dist.group.WORLD for kind in GROUP_KINDS)}


def test_initialize_without_launcher() -> None:
    out = run_distributed(_single_process, 1)[0]
    assert out == {"world": 1, "layout": ParallelLayout(), "value": 5.0, "all_world": True}


def _deepspeed_engine_step(rank: int, world_size: int) -> dict:
    """A real DeepSpeed engine with megacp's mpu: gradients are summed over the CP ranks."""
    from megacp.train.setup import deepspeed_for

    state = megacp.initialize({"context_parallel": {"size": 2}})
    deepspeed = deepspeed_for(state)  # DeepSpeed prepared as megacp.train prepares it (no shm op build on CPU)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=DeepSpeedMPU(state))
    x = torch.tensor([[1.0, 2.0, 3.0]]) * (rank + 1)  # each CP rank holds a different shard of one sequence
    engine.backward(engine(x).sum())
    engine.step()
    return {
        "weight": model.weight.detach().flatten().tolist(),
        "dp": engine.dp_world_size,
        "seq_dp": engine.seq_dp_world_size,
        "sp": engine.sequence_parallel_size,
        "mp": engine.mp_world_size,
    }


@pytest.mark.slow
def test_deepspeed_engine_reduces_over_cp() -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed: the engine/mpu integration cannot run")
    results = run_distributed(_deepspeed_engine_step, 2)
    torch.manual_seed(0)
    initial = torch.nn.Linear(3, 1, bias=False).weight.detach().flatten()
    grad_sum = torch.tensor([1.0, 2.0, 3.0]) * (1 + 2)
    expected = (initial - 0.5 * grad_sum).tolist()
    for out in results:
        assert (out["dp"], out["seq_dp"], out["sp"], out["mp"]) == (1, 2, 2, 1)
        assert out["weight"] == pytest.approx(expected, rel=1e-6)


def _ring_transports(rank: int, world_size: int) -> dict:
    """Transport selection on a gloo group: auto resolves to NCCL-style P2P, the copy engine is
    refused with one clear error, an unknown name too; rotation on the chosen transport is exact."""
    import torch

    from megacp.parallel.ring import Ring

    out: dict = {"auto": Ring(None).transport, "nccl": Ring(None, transport="nccl").transport}
    for bad in ("copy_engine", "shm"):
        try:
            Ring(None, transport=bad)
        except ValueError as err:
            out[bad] = str(err)
    ring = Ring(None)
    block = torch.full((3,), float(rank))
    out["seen"] = [int(b[0]) for _, b in ring.rotate(block)]
    out["block_kept"] = torch.equal(block, torch.full((3,), float(rank)))
    # a block of two parts (pass-KV's keys and values, not stacked): handed out stacked from step 1 on
    k, v = torch.full((4, 2), float(rank)), torch.full((4, 2), 10.0 + rank)
    out["pairs"] = [(step, tuple(b[0].shape), float(b[0][0, 0]), float(b[1][-1, -1])) for step, b in ring.rotate((k, v))]
    try:
        next(ring.rotate((k, v[:3])))
    except ValueError as err:
        out["bad_pair"] = str(err)
    return out


def test_ring_transport_selection_on_gloo() -> None:
    results = run_distributed(_ring_transports, 3)
    for rank, out in enumerate(results):
        assert out["auto"] == "nccl" and out["nccl"] == "nccl"
        assert "copy_engine" in out["copy_engine"] and "NCCL group of CUDA ranks" in out["copy_engine"]
        assert "not one of auto, nccl, copy_engine" in out["shm"]
        assert out["seen"] == [(rank - s) % 3 for s in range(3)] and out["block_kept"]
        assert out["pairs"] == [(s, (4, 2), float((rank - s) % 3), 10.0 + (rank - s) % 3) for s in range(3)]
        assert "one shape, dtype and device" in out["bad_pair"]


_FREEZE = """
import os, sys, time
import torch, torch.distributed as dist
import megacp
state = megacp.initialize({"runtime": {"timeout_minutes": 0.05}})
if state.rank == 1:
    time.sleep(120)  # frozen: alive, never joins the collective
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as err:
    print(f"rank 0 gave up after {time.monotonic() - t0:.1f} s: {err}", flush=True)
    os._exit(3)  # no process-group teardown: it would wait for the frozen peer
"""


def test_a_frozen_rank_ends_the_collective_after_the_configured_timeout() -> None:
    """runtime.timeout_minutes reaches the process group: 3 s, not gloo's 30-minute default."""
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _FREEZE], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=HANG_GUARD_S)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 3, err[-2000:]
    seconds = float(out.split("gave up after ")[1].split(" s")[0])
    assert 2.5 < seconds < 30 and "Timed out" in out, out
