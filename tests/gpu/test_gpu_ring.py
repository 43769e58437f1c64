"""The ring's GPU transports on 2 real GPUs (NCCL, symmetric memory): every rotation hands out the
right block, over many rotations of changing sizes (the window's flags count uses across
rotations), also when the transfers are ordered by a ``ready`` event behind which the caller queued
work and the blocks are consumed on a second stream, and for a block of two tensors (whole, or
only the leading rows a peer reads); both prefill strategies stay exact on each transport.

The test launches this file under ``torchrun`` (2 processes); it skips where fewer than 2 CUDA GPUs
exist (the CI machine). On the GPU machine: ``python -m pytest tests/gpu/test_gpu_ring.py`` or directly
``torchrun --standalone --nproc_per_node 2 tests/gpu/test_gpu_ring.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT


def _worker() -> None:
    """One rank: raise on any wrong block or output."""
    import torch.distributed as dist

    from megacp.attention import cp_attention, partial_attention
    from megacp.parallel.ring import Ring

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    r, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local)
    for transport in ("copy_engine", "nccl"):
        ring = Ring(None, transport=transport)
        aux = torch.cuda.Stream(device=dev)
        for i, numel in enumerate([15, 1 << 19, 1 << 25, 15, 1 << 25, 1 << 19]):
            block = torch.full((numel,), float(r * 100 + i), dtype=torch.bfloat16, device=dev)
            ready = consumer = None
            if i % 2:  # as pass-KV does: a long kernel queued first, transfers ordered by an event
                ready = torch.cuda.Event()
                ready.record()
                torch.cuda._sleep(2_000_000)
                consumer = aux
                aux.wait_event(ready)
            for step, held in ring.rotate(block, stream=consumer, ready=ready):
                with torch.cuda.stream(consumer if step and consumer is not None else torch.cuda.current_stream()):
                    torch.cuda._sleep(1_000_000)  # a long kernel on the compute stream before the check
                    want = float(((r - step) % n) * 100 + i)
                    bad = int((held != want).sum())
                if bad:
                    raise AssertionError(f"{transport} rotation {i} step {step}: {bad} wrong values")
            if not bool((block == float(r * 100 + i)).all()):
                raise AssertionError(f"{transport}: rotation {i} changed the caller's block")
        pair = tuple(torch.full((1 << 20, 8), float(r * 100 + j), dtype=torch.bfloat16, device=dev) for j in (7, 8))
        for rows in (None, [1 << 19] * n):  # every row; the first half only (pass-KV's later ranks)
            for step, held in ring.rotate(pair, rows=rows):  # keys and values travelling as two tensors
                torch.cuda._sleep(1_000_000)
                for j, part in zip((7, 8), held):
                    if not bool((part[: rows[r] if rows else None] == float(((r - step) % n) * 100 + j)).all()):
                        raise AssertionError(f"{transport} pair rotation step {step} rows {rows}: part {j} wrong")
        g = torch.Generator(device=dev).manual_seed(0)
        s, h, hkv, d = 24_576, 8, 2, 128
        q = torch.randn(s, h, d, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(s, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
        ref, _ = partial_attention(q, k, v, causal=True)
        for strategy in ("pass_kv", "pass_q"):
            for _ in range(3):  # back to back: buffers freed by one call are reused by the next
                out = cp_attention(q, k, v, Ring(transport=transport), strategy=strategy)
            err = (out.float() - ref.float()).abs().max().item()
            if not err <= 2e-2:
                raise AssertionError(f"{transport} {strategy}: max|cp - single| = {err}")
    dist.barrier()
    dist.destroy_process_group()
    if r == 0:
        print("GPU RING OK", flush=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL, symmetric memory): runs on the GPU machine")
def test_gpu_ring_transports() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "GPU RING OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    _worker()
