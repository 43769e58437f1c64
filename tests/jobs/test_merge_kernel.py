"""The fused Triton merges (``merge_stack`` / ``merge_into`` with ``fused=True``) against full attention, run by Triton's
CPU interpreter (``TRITON_INTERPRET=1``, set before Triton is imported: hence a subprocess). On GPU
machines the decode benchmark and ``tests/programs/gpu_verify.py`` run the compiled kernel against single-GPU
attention."""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import needs_triton, run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from megacp.attention.kernels import merge_kernel
    from megacp.attention.kernels.merge import merge_into, merge_stack, merge_states, pack_states, unpack_states
    from megacp.attention.kernels.partial import partial_attention
    from tests.helpers.reference import naive_attention, rel_err

    torch.manual_seed(0)
    for n, rows, hq, hkv, d, lk in [(2, 1, 8, 2, 64, 40), (3, 19, 4, 4, 32, 50), (4, 3, 4, 1, 16, 3)]:
        q, k, v = torch.randn(rows, hq, d), torch.randn(lk, hkv, d), torch.randn(lk, hkv, d)
        cuts = torch.linspace(0, lk, n + 1).long().tolist()  # n disjoint key ranges, some empty when lk < n
        states = [partial_attention(q, k[a:b], v[a:b]) for a, b in zip(cuts, cuts[1:])]
        packed = torch.stack([pack_states(o, l) for o, l in states])  # [N, rows, bytes], like an all-gather
        outs, lses = unpack_states(packed, hq, d, q.dtype)
        assert merge_kernel.available(outs, 4)
        out, lse = merge_stack(outs, lses, fused=True)
        pos = torch.zeros(rows, dtype=torch.long)
        ref = naive_attention(q, k, v, q_positions=pos, k_positions=torch.zeros(lk, dtype=torch.long))
        ref_lse = torch.logsumexp(torch.einsum("qhd,khd->qhk", q, k.repeat_interleave(hq // hkv, 1)) / d ** 0.5, -1)
        assert rel_err(out, ref) < 1e-5, (n, rel_err(out, ref))
        assert rel_err(lse, ref_lse) < 1e-5, (n, rel_err(lse, ref_lse))
        # the online merge, in place, on head-major views (the layout cuDNN's outputs have)
        acc_out = torch.zeros(hq, rows, d).transpose(0, 1)
        acc_lse = torch.full((hq, rows), float("-inf")).transpose(0, 1)
        assert merge_kernel.available(acc_out, 3)
        for o, l in states:
            merge_into(acc_out, acc_lse, o, l, fused=True)
        assert rel_err(acc_out, ref) < 1e-5 and rel_err(acc_lse, ref_lse) < 1e-5, (n, rel_err(acc_out, ref))
    # every partial empty: zeros and -inf, never NaN; bf16 outputs keep their dtype
    outs = torch.randn(3, 2, 4, 32).to(torch.bfloat16)
    lses = torch.full((3, 2, 4), float("-inf"))
    lses[1, 1] = 0.5
    out, lse = merge_stack(outs, lses, fused=True)
    assert out.dtype == torch.bfloat16 and not out.float().isnan().any()
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.equal(out[1], outs[1, 1]) and (lse[1] == 0.5).all()
    acc_out, acc_lse = torch.zeros(2, 4, 32), torch.full((2, 4), float("-inf"))
    merge_into(acc_out, acc_lse, outs[0].float(), lses[0], fused=True)  # empty into empty
    assert (acc_out == 0).all() and torch.isneginf(acc_lse).all()
    # mixed dtypes (fp32 running state, bf16 partial) merge in fp32 as merge_states does
    a_out, a_lse, b_out, b_lse = torch.randn(5, 4, 32), torch.randn(5, 4), torch.randn(5, 4, 32).bfloat16(), torch.randn(5, 4)
    want_out, want_lse = merge_states(a_out, a_lse, b_out, b_lse)
    merge_into(a_out, a_lse, b_out, b_lse, fused=True)
    assert rel_err(a_out, want_out) < 1e-6 and rel_err(a_lse, want_lse) < 1e-6
    # a NaN partial makes its row NaN (out and LSE), in both kernels; empty partials stay harmless
    lses = torch.randn(3, 2, 4)
    lses[1, 0, 2] = float("nan")
    lses[2, 1] = float("-inf")
    outs = torch.randn(3, 2, 4, 32)
    out, lse = merge_stack(outs, lses, fused=True)
    want_out, want_lse = merge_stack(outs, lses, fused=False)
    assert torch.equal(out.isnan(), want_out.isnan()) and out[0, 2].isnan().all() and out.isnan().sum() == 32
    assert lse[0, 2].isnan() and lse.isnan().sum() == 1 and torch.allclose(out.nan_to_num(), want_out.nan_to_num(), atol=1e-6)
    acc_out, acc_lse = outs[0].clone(), lses[0].clone()
    merge_into(acc_out, acc_lse, outs[1], lses[1], fused=True)
    assert acc_out[0, 2].isnan().all() and acc_out.isnan().sum() == 32 and acc_lse[0, 2].isnan() and acc_lse.isnan().sum() == 1
    print("fused merge ok")
    """
)


@needs_triton
def test_fused_merge_matches_full_attention() -> None:
    run_interpreted(SCRIPT, "fused merge ok")
