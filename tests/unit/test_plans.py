"""Length buckets of the cuDNN plans warmed before the first training step."""

from __future__ import annotations

import torch

from megacp.attention.plans import LONGEST_WARMED, plan_buckets, warm_kernel_plans


def test_buckets_reach_the_bucket_of_the_length() -> None:
    assert plan_buckets(0) == []
    assert plan_buckets(1) == [1]
    assert plan_buckets(5) == [1, 2, 4, 8]
    assert plan_buckets(8) == [1, 2, 4, 8]
    assert plan_buckets(8193) == [1 << k for k in range(15)]


def test_buckets_stop_at_the_longest_warmed() -> None:
    assert plan_buckets(1 << 20)[-1] == LONGEST_WARMED
    assert plan_buckets(100, longest=16) == [1, 2, 4, 8, 16]


def test_nothing_is_built_on_cpu() -> None:
    assert warm_kernel_plans(4, 2, 16, dtype=torch.bfloat16, device=torch.device("cpu"), tokens=4096) == []
