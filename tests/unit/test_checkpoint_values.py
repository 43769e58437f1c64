"""The finiteness check a checkpoint's weights pass (:func:`megacp.checkpoint.values.all_finite`, a sum
first, the elementwise check only when the sum is not finite) agrees with ``isfinite(...).all()``
on finite tensors, on sums that overflow the dtype although every value is finite, and on NaN, +inf
and -inf anywhere (including +inf and -inf together, whose sum is NaN)."""

from __future__ import annotations

import pytest
import torch

from megacp.checkpoint import CheckpointError
from megacp.checkpoint.values import all_finite, check_finite

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_finite_agrees_with_the_elementwise_check(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    cases = [torch.randn(4099, generator=gen).to(dtype),
             torch.full((4099,), big, dtype=dtype),  # finite values whose sum overflows
             torch.full((4099,), -big, dtype=dtype)]
    for base in list(cases):
        for bad in (float("nan"), float("inf"), float("-inf")):
            for where in (0, 2048, 4098):
                t = base.clone()
                t[where] = bad
                cases.append(t)
        both = base.clone()
        both[1], both[7] = float("inf"), float("-inf")
        cases.append(both)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(torch.arange(10)) and all_finite(torch.zeros(0, dtype=dtype))


def test_check_finite_names_the_tensor_and_counts_the_bad_values() -> None:
    t = torch.ones(3, 5)
    t[0, 1], t[2, 4] = float("nan"), float("inf")
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.w' in ckpt holds 2 non-finite value\(s\)"):
        check_finite("layers.0.w", t, "ckpt")
    ok = torch.ones(3)
    assert check_finite("w", ok, "ckpt") is ok
