"""The benchmark harness: one way to bring up the ranks, time a call, check an output and record
a run, shared by every benchmark and diagnostic.

Modules (one concept each): :mod:`~.cli` (size lists, common options), :mod:`~.context` (the ranks,
on :func:`megacp.initialize`; barrier, MAX reduction, agreement), :mod:`~.timing` (timing rules,
CUDA graphs, FLOPs), :mod:`~.data` (inputs made once and shared, outputs gathered), :mod:`~.accuracy`
(errors against the kernels and float64), :mod:`~.children` (points in child processes), :mod:`~.layouts` (the peers' row layouts),
:mod:`~.peers` (PyTorch CP, Transformer Engine CP, DeepSpeed-Ulysses), :mod:`~.report` (JSON with
the environment and a digest of the megacp sources; tables), :mod:`~.power` (SM clock and power).

Typical use::

    from scripts.bench import harness as bh

    ctx = bh.init("cuda", None)                      # every rank, under torchrun
    rep = bh.Report(ctx, "out/x.json", {**bh.env_info(ctx), "kind": "x"})
    tm = bh.measure(ctx, lambda: f(q), target_s=1.0)  # median ms of isolated calls, max over ranks
    rep.result({"method": "f", "ms": tm.ms})
    bh.finish(ctx)
"""

from scripts.bench.harness.accuracy import diff_stats, tolerance, truth_rows
from scripts.bench.harness.children import climb, header, print_result, run_child
from scripts.bench.harness.cli import DTYPES, add_common_args, parse_names, parse_sizes, size_label
from scripts.bench.harness.context import Ctx, agree, all_max, barrier, bcast_obj, finish, free, init, sync
from scripts.bench.harness.data import gather_rows, randn, sample_rows, shared_randn
from scripts.bench.harness.layouts import contiguous_index, load_balanced_index
from scripts.bench.harness.power import Sampler
from scripts.bench.harness.report import Report, env_info, fmt, print_table, sources_digest
from scripts.bench.harness.timing import Clock, Timing, attn_flops, capture_graph, measure, measure_loop, window_ms

__all__ = [
    "DTYPES", "Clock", "Ctx", "Report", "Sampler", "Timing", "add_common_args", "agree", "all_max", "attn_flops",
    "barrier", "bcast_obj", "capture_graph", "climb", "contiguous_index", "diff_stats", "env_info", "finish", "fmt",
    "free", "gather_rows", "header", "init", "load_balanced_index", "measure", "measure_loop", "parse_names",
    "parse_sizes", "print_result", "print_table", "randn", "sample_rows", "run_child", "shared_randn", "size_label",
    "sources_digest", "sync", "tolerance", "truth_rows", "window_ms",
]
