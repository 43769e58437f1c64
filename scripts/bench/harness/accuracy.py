"""How far a CP output is from the single-GPU kernels and from exact attention (float64)."""

from __future__ import annotations

import math

import torch


def diff_stats(a: torch.Tensor, b: torch.Tensor, *, chunk_rows: int = 4096) -> dict[str, float]:
    """Max / mean absolute difference of two same-shape tensors (fp32, row chunks, no big temporaries);
    ``nan`` when either has a non-finite value.

    Raises:
        ValueError: the shapes differ.
    """
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    mx, tot, n = 0.0, 0.0, 0
    for i in range(0, a.shape[0], chunk_rows):
        x, y = a[i:i + chunk_rows].float(), b[i:i + chunk_rows].float()
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            return {"max_abs": float("nan"), "mean_abs": float("nan")}
        d = (x - y).abs()
        mx = max(mx, d.max().item())
        tot += d.sum().item()
        n += d.numel()
    return {"max_abs": mx, "mean_abs": tot / max(n, 1)}


def tolerance(ref: torch.Tensor, noise: float | None, dtype: torch.dtype) -> float:
    """Allowed ``max|cp - ref|``: 4× the kernels' disagreement (``noise``: flash vs cuDNN) plus a floor of
    2 units in the last place of ``ref``'s largest magnitude (half precision; 1e-4 for fp32)."""
    if dtype == torch.float32:
        floor = 1e-4
    else:
        mag = max(float(ref.abs().max()), 1e-30)
        floor = max(1e-3, 2 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(mag)))
    return 4 * (noise or 0.0) + floor


def truth_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, *,
               causal: bool = True, chunk: int = 8) -> torch.Tensor:
    """Exact attention (float64) of the queries ``q[rows]`` of one request.

    q ``[Lq, Hq, D]``, k/v ``[Lk, Hkv, D]``; causal is bottom-right aligned (query i sees keys
    ``j <= i + Lk - Lq``), GQA maps query head h to KV head ``h // (Hq // Hkv)``.
    Returns ``[len(rows), Hq, D]`` float64.
    """
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    g = hq // hkv
    scale = 1.0 / math.sqrt(d)
    outs = []
    kd = k.double().permute(1, 0, 2)  # [Hkv, Lk, D]
    vd = v.double().permute(1, 0, 2)
    for i in range(0, rows.numel(), chunk):
        r = rows[i:i + chunk].to(q.device)
        qd = q[r].double().reshape(-1, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, n*G, D]
        s = torch.bmm(qd, kd.transpose(1, 2)) * scale  # [Hkv, n*G, Lk]
        if causal:
            lim = (r + (lk - lq)).repeat_interleave(g)  # [n*G]
            mask = torch.arange(lk, device=q.device)[None, :] > lim[:, None]
            s.masked_fill_(mask[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.bmm(p, vd)  # [Hkv, n*G, D]
        outs.append(o.reshape(hkv, -1, g, d).permute(1, 0, 2, 3).reshape(-1, hq, d))
    return torch.cat(outs)
