"""The FP8 decode kernel (:mod:`megacp.attention.kernels.fp8_decode_kernel`) against attention over the
dequantised rows (fp32, masked, computed here), run by Triton's CPU interpreter
(``TRITON_INTERPRET=1``, set before Triton is imported: hence a subprocess). Covers GQA groups of 1,
4 and 8, requests of 0, 1, a few and all ``capacity`` rows (several key splits), scales that differ
per request and head, and the ``uint8`` views the cache hands over. On GPU machines
``tests/programs/graph_decode_check.py`` runs the compiled kernel inside the CUDA-graph decode step."""

from __future__ import annotations

import textwrap

from tests.helpers.triton_interpreter import needs_triton, run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from megacp.attention.kernels import fp8_decode_kernel as fk
    from megacp.kv_cache import quantize_fp8

    fk._ROWS_PER_SPLIT = 48  # several splits of a small capacity
    torch.manual_seed(0)
    for hq, hkv, d in [(4, 4, 16), (8, 2, 32), (8, 1, 16)]:
        capacity, slots = 200, 4
        used = torch.tensor([0, 1, 77, 200], dtype=torch.int32)
        starts = torch.tensor([3, 0, 2, 1], dtype=torch.long) * capacity  # any slot order
        x = torch.randn(2, slots * capacity, hkv, d) * torch.rand(1, 1, hkv, 1) * 20
        scales = torch.exp2(torch.randint(-4, 3, (4, 2, hkv)).float())  # [B, 2, Hkv] per request
        k8 = torch.empty(slots * capacity, hkv, d, dtype=torch.float8_e4m3fn)
        v8 = torch.empty_like(k8)
        for b in range(4):
            rows = slice(int(starts[b]), int(starts[b]) + capacity)
            k8[rows] = quantize_fp8(x[0, rows], scales[b, 0, :, None])
            v8[rows] = quantize_fp8(x[1, rows], scales[b, 1, :, None])
        q = torch.randn(4, hq, d).bfloat16()
        assert fk.available(q, k8)
        out, lse = fk.fp8_cache_decode_states(q, k8.view(torch.uint8), v8.view(torch.uint8), scales, starts, used,
                                              capacity, scale=d ** -0.5)
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        for b in range(4):
            n = int(used[b])
            if n == 0:
                assert (out[b] == 0).all() and torch.isneginf(lse[b]).all(), (out[b], lse[b])
                continue
            rows = slice(int(starts[b]), int(starts[b]) + n)
            kk = (k8[rows].float() * scales[b, 0, :, None]).repeat_interleave(hq // hkv, 1)
            vv = (v8[rows].float() * scales[b, 1, :, None]).repeat_interleave(hq // hkv, 1)
            s = torch.einsum("hd,khd->hk", q[b].float(), kk) * d ** -0.5
            ref_lse = torch.logsumexp(s, -1)
            ref = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vv)
            err = float((out[b].float() - ref).abs().max() / ref.abs().max())
            assert err < 2e-2, (hq, hkv, d, b, err)
            assert float((lse[b] - ref_lse).abs().max()) < 2e-2, (lse[b], ref_lse)
    print("fp8 decode ok")
    """
)


@needs_triton
def test_fp8_decode_kernel_matches_dequantised_attention() -> None:
    run_interpreted(SCRIPT, "fp8 decode ok")
