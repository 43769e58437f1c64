"""The CP cost model (:mod:`scripts.perf_model`) against the recorded 2× H200 runs, its projections
to 4-128 GPUs, the paper's Llama3-405B numbers, and the efficiency plot.

    python -m scripts.perf_model.report                       # tables + docs/scaling_efficiency.png
    python -m scripts.perf_model.report --plot ''             # tables only

The plot needs matplotlib (``pip install matplotlib``); without it the tables still print.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from scripts import perf_model as pm
from scripts.perf_model.validation import PREFILL_RUN, TTFT_RUN, ttft_rows

ROOT = Path(__file__).resolve().parents[2]

CP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
LENGTHS = (131072, 262144, 1 << 20)
NETS = (("400 Gb/s", pm.H200), ("800 Gb/s", pm.H200_FAST_NET))
PAPER_CP = (1, 2, 4, 8, 16)
PAPER_EFFICIENCY_1M = 0.93
H100_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM (datasheet)


def label(tokens: int) -> str:
    return f"{tokens >> 20}M" if tokens % (1 << 20) == 0 else f"{tokens >> 10}K"


def fmt_s(seconds: float) -> str:
    """Seconds with a unit that keeps 3-4 significant digits."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} µs"


def print_validation(checks: list[pm.Check], results: str) -> None:
    print(f"## Validation against the recorded 2x H200 runs ({results}: the files pm.validate names)\n")
    print("| measurement | measured | predicted | error | role |")
    print("|---|---|---|---|---|")
    for c in checks:
        print(f"| {c.name} | {fmt_s(c.measured_s)} | {fmt_s(c.predicted_s)} | {c.error * 100:+.1f}% | {c.role} |")
    worst = max(checks, key=lambda c: abs(c.error))
    pred = [c for c in checks if c.role == "pred"]
    print(f"\nworst |error|: {abs(worst.error) * 100:.1f}% ({worst.name}); "
          f"worst among predictions: {max(abs(c.error) for c in pred) * 100:.1f}%\n")


def attention_efficiency(m: pm.Machine, tokens: int, cp: int) -> tuple[pm.PrefillCost, float]:
    """Pass-KV prefill of the Llama-3-8B attention shape and T1 / (cp · T_cp)."""
    t1 = pm.prefill_time(m, pm.H200_ATTN, tokens, cp=1).total_s
    cost = pm.prefill_time(m, pm.H200_ATTN, tokens, cp=cp)
    return cost, t1 / (cp * cost.total_s)


def print_attention_projection() -> None:
    print("## Projection: prefill attention (Llama-3-8B shape, 32 Q / 8 KV heads, bf16), one H200 per CP rank\n")
    print("NVLink inside a node of 8; between nodes 400 Gb/s or 800 Gb/s per GPU. Cells: time · efficiency "
          "T1/(N·T_N) · exposed communication. Strategy: pass-KV (the paper's rule, applied through "
          "choose_strategy, picks it for every full prefill here). 'ring BW to hide' = per-GPU link bandwidth "
          "at which every ring transfer just hides behind compute.\n")
    for tokens in (131072, 1 << 20):
        t1 = pm.prefill_time(pm.H200, pm.H200_ATTN, tokens, cp=1).total_s
        source = "measured" if tokens in pm.H200_CAUSAL_S else "extrapolated"
        print(f"### {label(tokens)} tokens (T1 = {fmt_s(t1)}, {source})\n")
        print("| CP | " + " | ".join(name for name, _ in NETS) + " | comm-free bound | ring BW to hide | decode B=1 |")
        print("|---|" + "---|" * (len(NETS) + 3))
        for cp in CP_SIZES[1:]:
            cells = []
            for _, m in NETS:
                cost, eff = attention_efficiency(m, tokens, cp)
                cells.append(f"{fmt_s(cost.total_s)} · {eff:.2f} · {fmt_s(cost.exposed_comm_s)}")
            free = pm.prefill_time(pm.H200.comm_free(), pm.H200_ATTN, tokens, cp=cp).total_s
            ring = pm.prefill_time(pm.H200, pm.H200_ATTN, tokens, cp=cp).hide_bandwidth
            dec = pm.decode_time(pm.H200, pm.H200_ATTN, tokens, 1, cp=cp).total_s
            print(f"| {cp} | " + " | ".join(cells) + f" | {fmt_s(free)} · {t1 / (cp * free):.2f} | "
                  f"{ring / 1e9:.1f} GB/s | {fmt_s(dec)} |")
        single_dec = pm.decode_time(pm.H200, pm.H200_ATTN, tokens, 1, cp=1).total_s
        print(f"\n(decode B=1 on one GPU: {fmt_s(single_dec)})\n")


def print_ttft_projection() -> None:
    print("## Projection: TTFT of a Llama-3-8B-shaped model (32 layers), one H200 per CP rank, 400 Gb/s between nodes\n")
    print("| CP | " + " | ".join(f"{label(s)} TTFT · efficiency" for s in (131072, 1 << 20)) + " |")
    print("|---|---|---|")
    base = {s: pm.ttft(pm.H200, pm.LLAMA3_8B, s, cp=1).total_s for s in (131072, 1 << 20)}
    for cp in CP_SIZES:
        cells = []
        for s, t1 in base.items():
            t = pm.ttft(pm.H200, pm.LLAMA3_8B, s, cp=cp).total_s
            cells.append(f"{fmt_s(t)} · {t1 / (cp * t):.2f}")
        print(f"| {cp} | " + " | ".join(cells) + " |")
    print()


def h100_like(m: pm.Machine) -> pm.Machine:
    """H200 kernel rates standing in for H100 (same GH100 SMs and clocks); HBM and copy bandwidths
    scaled by the datasheets' ratio, 3.35 / 4.8 TB/s."""
    scale = 3.35 / 4.8
    return replace(m, name=f"H100-like, {m.name}", hbm_bandwidth=m.hbm_bandwidth * scale,
                      copy_bandwidth=m.copy_bandwidth * scale)


def print_paper_comparison() -> None:
    print("## The paper's layout: Llama3-405B, CP over nodes × TP8 inside a node (16 nodes = 128 GPUs)\n")
    print("Per CP rank one node of 8 GPUs: per GPU 16 Q / 1 KV heads and 1/8 of the linear layers, two "
          "TP all-reduces per layer on NVLink; H200 kernel rates stand in for H100, HBM scaled by 3.35/4.8 (datasheets); "
          "400 Gb/s per GPU between nodes. 'ring BW' = per-GPU bandwidth that hides every ring transfer.\n")
    m, fast = h100_like(pm.H200), h100_like(pm.H200_FAST_NET)
    tokens = tuple(pm.PAPER_405B_TTFT_S)
    shape = pm.AttnShape.of(pm.LLAMA3_405B, 8)
    base = {s: pm.ttft(m, pm.LLAMA3_405B, s, cp=1, tp=8).total_s for s in tokens}
    print("| CP × TP | GPUs | " + " | ".join(f"{label(s)} TTFT · eff · ring BW" for s in tokens)
          + " | 1M: attention / linear / TP all-reduce | 1M, 800 Gb/s |")
    print("|---|---|---|---|---|---|")
    for cp in PAPER_CP:
        cells, last = [], None
        for s in tokens:
            last = pm.ttft(m, pm.LLAMA3_405B, s, cp=cp, tp=8)
            ring = pm.prefill_time(m, shape, s, cp=cp, tp=8).hide_bandwidth
            ring_txt = f"{ring / 1e9:.1f} GB/s" if ring else "no ring"
            cells.append(f"{fmt_s(last.total_s)} · {base[s] / (cp * last.total_s):.2f} · {ring_txt}")
        parts = f"{fmt_s(last.attention_s)} / {fmt_s(last.linear_s)} / {fmt_s(last.tp_comm_s)}"
        quick = pm.ttft(fast, pm.LLAMA3_405B, tokens[-1], cp=cp, tp=8).total_s
        print(f"| {cp} × 8 | {cp * 8} | " + " | ".join(cells) + f" | {parts} | {fmt_s(quick)} |")
    paper = ", ".join(f"{label(s)}: {t} s" for s, t in pm.PAPER_405B_TTFT_S.items())
    print(f"\nPaper (16 nodes × 8 H100, CP16 × TP8, measured): {paper}; 1M at {PAPER_EFFICIENCY_1M:.0%} "
          "parallel efficiency, 63% FLOPS utilisation.")
    for s, t_paper in pm.PAPER_405B_TTFT_S.items():
        pred = pm.ttft(m, pm.LLAMA3_405B, s, cp=16, tp=8).total_s
        flops = s * pm.linear_flops_per_token(pm.LLAMA3_405B) + pm.LLAMA3_405B.num_layers * pm.AttnShape.of(
            pm.LLAMA3_405B).causal_flops(s)
        print(f"  {label(s)}: model {fmt_s(pred)} vs paper {t_paper} s ({pred / t_paper - 1:+.0%}); model's "
              f"{flops / pred / 128 / 1e12:.0f} TFLOP/s per GPU = {flops / pred / 128 / H100_PEAK:.0%} of "
              f"the H100's {H100_PEAK / 1e12:.0f} TFLOP/s dense bf16 peak")
    flat_rate = 600e12
    flat = replace(m, kernels=replace(m.kernels, causal=((1.0, flat_rate),), dense=((1.0, flat_rate),), half_flops=0.0))
    effs = []
    for s in tokens:
        t1 = pm.ttft(flat, pm.LLAMA3_405B, s, cp=1, tp=8).total_s
        effs.append(f"{label(s)} {t1 / (16 * pm.ttft(flat, pm.LLAMA3_405B, s, cp=16, tp=8).total_s):.2f}")
    print(f"  with one size-independent attention rate ({flat_rate / 1e12:.0f} TFLOP/s per GPU) instead of the "
          f"measured table, CP16 efficiency: {', '.join(effs)}")
    print()


def plot(path: Path, results: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path} not written (pip install matplotlib)")
        return
    pre = json.loads((results / PREFILL_RUN).read_text())
    measured = {r["seqlen"]: r["efficiency"] for r in pre["results"] if r["method"] == "megacp_pass_kv"}
    gen = ttft_rows(json.loads((results / TTFT_RUN).read_text()))
    cps = CP_SIZES[1:]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    colors = dict(zip(LENGTHS, ("tab:blue", "tab:orange", "tab:green")))
    for tokens in LENGTHS:
        for (name, m), style in zip(NETS, ("-", "--")):
            effs = [attention_efficiency(m, tokens, cp)[1] for cp in cps]
            ax1.plot(cps, effs, style, color=colors[tokens], marker="o" if style == "-" else None, ms=4,
                     label=f"{label(tokens)}, {name}")
        if tokens in measured:
            ax1.plot([2], [measured[tokens]], "*", color=colors[tokens], ms=16, mec="black",
                     label=f"{label(tokens)} measured (2× H200)")
    ax1.set_title("Prefill attention, pass-KV (Llama-3-8B heads), 1 H200 per CP rank")
    ax1.set_ylabel("parallel efficiency T1 / (N · T_N)")
    for tokens, color in ((131072, "tab:blue"), (1 << 20, "tab:green")):
        base = pm.ttft(pm.H200, pm.LLAMA3_8B, tokens, cp=1).total_s
        effs = [base / (cp * pm.ttft(pm.H200, pm.LLAMA3_8B, tokens, cp=cp).total_s) for cp in cps]
        ax2.plot(cps, effs, "-", color=color, marker="o", ms=4, label=f"Llama-3-8B TTFT {label(tokens)}, CP=N")
        h100 = h100_like(pm.H200)
        base = pm.ttft(h100, pm.LLAMA3_405B, tokens, cp=1, tp=8).total_s
        gpus = [8 * cp for cp in PAPER_CP]
        effs = [base / (cp * pm.ttft(h100, pm.LLAMA3_405B, tokens, cp=cp, tp=8).total_s) for cp in PAPER_CP]
        ax2.plot(gpus, effs, ":", color=color, marker="s", ms=4,
                 label=f"Llama3-405B TTFT {label(tokens)}, CP=N/8 × TP8 (H100-like)")
    for row in gen:
        if row["seqlen"] == 131072:
            ax2.plot([2], [row["cp1_ttft_s"] / (2 * row["cp2_ttft_s"])], "*", color="tab:blue", ms=16, mec="black",
                     label=f"Llama-3-8B {label(row['seqlen'])} measured (2× H200)")
    ax2.plot([128], [PAPER_EFFICIENCY_1M], "P", color="tab:red", ms=12, mec="black", label="paper: 405B 1M on 128 H100")
    ax2.set_title("Generation TTFT, 400 Gb/s per GPU between nodes")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(cps), [str(c) for c in cps])
        ax.axvline(8, color="grey", lw=0.8, ls=":")
        ax.text(8.3, 1.24, "← one node | across nodes →", color="grey", fontsize=8)
        ax.set_ylim(0, 1.3)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("GPUs (N)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.suptitle("megacp CP scaling, cost model calibrated on 2× H200 (lines) vs measurements (markers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=str(ROOT / "docs" / "results"), help="folder of the recorded runs that scripts.perf_model.validate reads")
    p.add_argument("--plot", default=str(ROOT / "docs" / "scaling_efficiency.png"), help="PNG to write ('' = none)")
    args = p.parse_args()
    if not Path(args.results).is_dir():
        p.error(f"--results {args.results} is not a directory")
    print_validation(pm.validate(pm.H200, args.results), args.results)
    print_attention_projection()
    print_ttft_projection()
    print_paper_comparison()
    if args.plot:
        plot(Path(args.plot), Path(args.results))


if __name__ == "__main__":
    main()
