"""The exactness program ``tests/programs/gpu_verify.py`` under ``torchrun``, 2 ranks.

On CPU it runs the same checks at small sizes in fp32 (gloo, the reference kernels): CP prefill of
whole, odd-length and unbalanced sequences, a ragged batch with cached prefixes and ragged /
batched decode, each against the single-process kernels and float64 attention. With 2 GPUs it runs
them in bf16 on NCCL at 16K-64K tokens against cuDNN and flash (CUDA graphs included).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers.distributed import free_port
from tests.helpers.paths import ROOT

CPU_SIZES = ["--device", "cpu", "--dtype", "float32", "--heads", "8", "--kv-heads", "2", "--head-dim", "32",
             "--seqlens", "256", "--odd-extra", "5", "--ragged", "64:32,0:48,40:1,50:17", "--decode", "300:5,1:0",
             "--decode-batched", "2:256", "--rows", "16"]
GPU_SIZES = ["--seqlens", "16K,64K", "--ragged", "8K:4K,0:12K,20000:1,5:9000", "--decode", "128K:5,65537:0,1:0",
             "--decode-batched", "4:64K"]


def run_verify(args: list[str], *, cpu: bool, timeout_s: int) -> tuple[int, int, str]:
    """``torchrun --nproc_per_node 2 -m tests.programs.gpu_verify ARGS``: (passed, failed, output)."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks even on a GPU host
    else:
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "-m", "tests.programs.gpu_verify", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout + proc.stderr
    m = re.search(r"(\d+) passed, (\d+) failed", out)
    assert proc.returncode == 0 and m, out[-4000:]
    return int(m.group(1)), int(m.group(2)), out


@pytest.mark.slow
def test_exactness_checks_pass_on_two_cpu_ranks() -> None:
    passed, failed, out = run_verify(CPU_SIZES, cpu=True, timeout_s=300)
    # prefill S, S+5 (2 strategies each), S unbalanced; ragged (2 strategies); decode ragged; batched eager
    assert (passed, failed) == (9, 0), out[-4000:]
    assert "FAIL" not in out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="the bf16 exactness checks on NCCL need 2 CUDA GPUs")
def test_exactness_checks_pass_on_two_gpus() -> None:
    passed, failed, out = run_verify(GPU_SIZES, cpu=False, timeout_s=600)
    assert failed == 0 and passed >= 10, out[-4000:]
