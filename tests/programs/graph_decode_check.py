"""CUDA-graph decode against eager decode on the GPU (run by tests/distributed/test_graph_decode.py when CUDA
is available).

    python tests/programs/graph_decode_check.py                      # one GPU, CP = 1
    torchrun --nproc_per_node 2 tests/programs/graph_decode_check.py # CP = 2 (NCCL collectives in the graph)
    ... graph_decode_check.py --kv-cache-dtype fp8_e4m3              # every check on an FP8 KV cache

Models (random weights): a tiny Llama (2 layers, 4 Q / 2 KV heads, head dim 16) and the SmolLM2-135M
shape (``scripts.bench.decode_hf.MODELS["smollm2"]``), each in float32 and bfloat16. Per case:

* ``kernel``: :func:`megacp.attention.kernels.partial.cache_decode_states` (flash varlen with ``seqused_k``
  for bf16, the masked fp32 path for fp32) against ``partial_attention`` per request, lengths 0, 1,
  37 and the whole capacity: out (fp32 1e-5, bf16 3e-2 relative) and LSE (1e-5 / 1e-3 absolute).
* ``step``: a ragged batch (3, 50, 200 tokens) prefilled into two caches; 64 steps of eager
  ``Generator.decode_step`` against a captured :class:`~megacp.generate.graph.BatchDecoder` fed
  the same tokens: logits within fp32 1e-5 (relative to the largest logit) or bf16 3e-2, and the
  same argmax (bf16: unless the eager top-2 margin is within twice that row's difference).
  With an FP8 cache each path stores what it computes: the static step's keys and values come
  from other kernels (attention over the masked capacity rows), a last-bit difference from layer 1
  on, and where a value lies that close to a rounding boundary of ``float8_e4m3fn`` the two caches
  hold neighbouring codes, a jump of one e4m3 spacing (2**-3 of the value's binade, twice the
  cache's own rounding bound 2**-4). Later layers and steps see it and the paths drift apart, by
  at most what the FP8 rounding itself does to the logits (on CPU, the same steps run eagerly,
  SmolLM2 shape: 2 flipped bytes and 2e-6 after one step, 155 and 1.8e-4 after 12; an unquantised
  cache: 7e-7). So under FP8 the check asks for what the rounding allows: every byte where the
  two caches differ is a neighbouring code (anything else, e.g. a row or scale written wrong,
  fails), the logits within :data:`FP8_TOL` (the bound of the ``fp8`` check on FP8 against an
  unquantised cache) and the same argmax unless the eager top-2 margin is within twice that
  row's difference.
* ``generate``: ``LLM(cuda_graphs=True)`` against an LLM decoding with eager steps
  (``cuda_graphs=False``, ``generator.static_step = False``), 72 greedy tokens of
  the ragged batch, then with a stop token that ends one request early (the one-step lag drops its
  extra token): identical tokens; the report says ``decode: cuda_graph``.
* ``session``: two turns of a session on each LLM: identical tokens (the graph of turn 1 replays
  in turn 2).
* ``sampled``: a mixed batch (greedy; temperature 0.8 / top-p 0.9 / seed 1; top-k, min-p and
  repetition / presence / frequency penalties) through both LLMs, and the nucleus request alone on
  the graph LLM: identical tokens (the sampler runs inside the captured step).

With ``--kv-cache-dtype fp8_e4m3`` both LLMs of every case keep an FP8 cache (bf16 decode reads the
FP8 rows as stored, :mod:`megacp.attention.kernels.fp8_decode_kernel`, checked first against attention over
the dequantised rows by ``fp8 kernel``; fp32 decode dequantises the rows it gathers; pass-KV prefill at CP = 2 passes the FP8 bytes over NCCL or the
copy engine), and one more check per case, ``fp8``, feeds the eager FP8 LLM and an eager LLM with
the unquantised cache the unquantised one's greedy tokens (prefill + 32 steps) and reports the
largest logit difference relative to the largest logit (PASS at most :data:`FP8_TOL`) and the
greedy tokens that differ (WARN: near ties).

Every check prints one ``PASS``/``FAIL``/``WARN`` line (bf16 end-to-end token differences after the
first are ``WARN``: a near-tie under bf16 noise; the ``step`` check judges bf16). Exceptions are
printed with the case and check. Ends with ``ALL PASS`` or ``FAILED: n``; exit status 0 / 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from scripts.bench.decode_hf import MODELS, hf_copy

TINY = dict(MODELS["smollm2"], hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=2048)
PROMPT_LENS = (3, 50, 200)
STEPS = 64
NEW = 72
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
FP8_TOL = 0.1
"""Largest |FP8 - unquantised cache| logit over the largest logit (measured on CPU in fp32: 0.057 on
the tiny random Llama of tests/distributed/test_fp8_kv_cache.py, 0.031 on SmolLM2-135M-Instruct)."""


class Checks:
    """PASS/FAIL/WARN lines (rank 0 prints) and the failure count."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failed = rank, 0

    def say(self, verdict: str, what: str, detail: str) -> None:
        self.failed += verdict == "FAIL"
        if self.rank == 0:
            print(f"{verdict} {what}: {detail}", flush=True)

    def run(self, what: str, fn: Callable[..., tuple[str, str]], *args: Any) -> None:
        """Say ``fn(*args)``'s verdict and detail (an exception: FAIL, its traceback on rank 0)."""
        try:
            verdict, detail = fn(*args)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next check
            verdict, detail = "FAIL", f"{type(exc).__name__}: {exc}"
            if self.rank == 0:
                traceback.print_exc(limit=8)
        self.say(verdict, what, detail)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def check_kernel(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> tuple[str, str]:
    from megacp.attention.kernels.partial import cache_decode_states, partial_attention

    cap, used = 64, [0, 1, 37, 64]
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(len(used) * cap, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(len(used) * cap, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    q = torch.randn(len(used), heads, head_dim, device="cuda", generator=g).to(dtype)
    starts = torch.arange(len(used), device="cuda") * cap
    out, lse = cache_decode_states(q, k, v, starts, torch.tensor(used, dtype=torch.int32, device="cuda"), cap)
    worst_o = worst_l = 0.0
    for b, n in enumerate(used):
        if n == 0:
            if out[b].abs().max() != 0 or not torch.isneginf(lse[b]).all():
                return "FAIL", "a request with no rows must give out = 0 and LSE = -inf"
            continue
        ro, rl = partial_attention(q[b:b + 1].float(), k[b * cap:b * cap + n].float(), v[b * cap:b * cap + n].float(),
                                   backend="reference")
        worst_o = max(worst_o, float((out[b].float() - ro[0]).abs().max() / ro.abs().max()))
        worst_l = max(worst_l, float((lse[b] - rl[0]).abs().max()))
    tol, lse_tol = TOL[dtype], 1e-5 if dtype == torch.float32 else 1e-3
    ok = worst_o <= tol and worst_l <= lse_tol
    return ("PASS" if ok else "FAIL"), f"out rel err {worst_o:.2e} (tol {tol:g}), LSE abs err {worst_l:.2e} (tol {lse_tol:g})"


def check_fp8_kernel(heads: int, kv_heads: int, head_dim: int) -> tuple[str, str]:
    """The compiled FP8 decode kernel (bf16 queries) against fp32 attention over the dequantised
    rows: requests of 0, 1, 37 and all rows of a 64-row capacity, and one of 300K rows (64 key splits)."""
    from megacp.attention.kernels.fp8_decode_kernel import fp8_cache_decode_states
    from megacp.attention.kernels.partial import partial_attention
    from megacp.kv_cache import quantize_fp8

    worst_o = worst_l = 0.0
    g = torch.Generator(device="cuda").manual_seed(0)
    for cap, used in ((64, [0, 1, 37, 64]), (300_000, [299_999])):
        b = len(used)
        x = torch.randn(2, b * cap, kv_heads, head_dim, device="cuda", generator=g) * 3
        scales = torch.exp2(torch.randint(-3, 3, (b, 2, kv_heads), device="cuda", generator=g).float())
        k8, v8 = (quantize_fp8(x[i].view(b, cap, kv_heads, head_dim), scales[:, i, None, :, None]).view(b * cap, kv_heads, head_dim)
                  for i in range(2))
        q = torch.randn(b, heads, head_dim, device="cuda", generator=g).bfloat16()
        starts = torch.arange(b, device="cuda") * cap
        out, lse = fp8_cache_decode_states(q, k8.view(torch.uint8), v8.view(torch.uint8), scales, starts,
                                           torch.tensor(used, dtype=torch.int32, device="cuda"), cap, scale=head_dim ** -0.5)
        for i, n in enumerate(used):
            if n == 0:
                if out[i].abs().max() != 0 or not torch.isneginf(lse[i]).all():
                    return "FAIL", "a request with no rows must give out = 0 and LSE = -inf"
                continue
            rows = slice(i * cap, i * cap + n)
            ro, rl = partial_attention(q[i:i + 1].float(), k8[rows].float() * scales[i, 0, :, None],
                                       v8[rows].float() * scales[i, 1, :, None], backend="reference")
            worst_o = max(worst_o, float((out[i].float() - ro[0]).abs().max() / ro.abs().max()))
            worst_l = max(worst_l, float((lse[i] - rl[0]).abs().max()))
    tol, lse_tol = TOL[torch.bfloat16], 1e-2
    ok = worst_o <= tol and worst_l <= lse_tol
    return ("PASS" if ok else "FAIL"), f"out rel err {worst_o:.2e} (tol {tol:g}), LSE abs err {worst_l:.2e} (tol {lse_tol:g})"


def check_step(llm: Any, dtype: torch.dtype) -> tuple[str, str]:
    from tests.helpers.static_decode import fixed_batch

    gen = llm.generator
    ps = prompts(llm.model_config.vocab_size)
    (eager, se), (static, ss) = (gen.batch_cache(ps, STEPS + 2) for _ in range(2))
    fp8 = eager.quantized
    tol = FP8_TOL if fp8 else TOL[dtype]
    worst, bad = 0.0, 0
    with torch.inference_mode():
        tok = gen.prefill(eager, se, ps)[0].argmax(-1)
        logits = gen.prefill(static, ss, ps)[0]
        dec = fixed_batch(gen.model, static, ss, gen.settings, gen.device, logits.argmax(-1), logits.shape[-1],
                          capture=True)
        for _ in range(STEPS):
            ref = gen.decode_step(eager, se, tok)
            got = dec.step().clone()
            diff = (dec.logits - ref).abs().amax(-1)
            worst = max(worst, float(diff.max() / ref.abs().max()))
            tok = ref.argmax(-1)
            top2 = ref.topk(2, dim=-1).values
            for i in torch.nonzero(got != tok).flatten().tolist():
                near_tie = (fp8 or dtype != torch.float32) and float(top2[i, 0] - top2[i, 1]) <= 2 * float(diff[i])
                bad += not near_tie
            dec.tokens.copy_(tok)  # teacher forcing: both sides see the eager token next
    ok = worst <= tol and bad == 0
    detail = f"{STEPS} steps, logits rel err {worst:.2e} (tol {tol:g}), {bad} argmax differences"
    if fp8:
        flipped, far = fp8_code_differences(eager, static)
        ok &= far == 0
        detail += f"; {flipped} of {eager.k.numel() + eager.v.numel()} FP8 bytes differ, {far} not by one code"
    return ("PASS" if ok else "FAIL"), detail


def fp8_code_differences(a: Any, b: Any) -> tuple[int, int]:
    """Bytes where two FP8 caches' keys and values differ, and those that are not neighbouring
    ``float8_e4m3fn`` codes (codes ordered by value: sign-magnitude, +0 and -0 both 0)."""
    differ = far = 0
    for x, y in ((a.k, b.k), (a.v, b.v)):
        bx, by = x.view(torch.uint8), y.view(torch.uint8)
        ox, oy = (torch.where(t >= 128, 128 - t, t) for t in (bx.int(), by.int()))
        differ += int((bx != by).sum())
        far += int(((ox - oy).abs() > 1).sum())
    return differ, far


def compare(a: list[list[int]], b: list[list[int]], dtype: torch.dtype) -> tuple[str, str]:
    if a == b:
        return "PASS", f"{sum(map(len, a))} tokens identical"
    first = min((j, i) for i, (x, y) in enumerate(zip(a, b)) for j, (p, q) in enumerate(zip(x + [-1], y + [-2])) if p != q)
    verdict = "WARN" if dtype != torch.float32 and first[0] > 0 else "FAIL"
    return verdict, f"request {first[1]} differs from token {first[0]} (lengths {[len(x) for x in a]} vs {[len(x) for x in b]})"


def check_generate(graph: Any, eager: Any, dtype: torch.dtype) -> tuple[str, str]:
    from megacp import SamplingParams

    ps = prompts(graph.model_config.vocab_size)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    e = [o.token_ids for o in eager.generate(ps, params)]
    gr = [o.token_ids for o in graph.generate(ps, params)]
    if graph.last_report.get("decode") != "cuda_graph" or eager.last_report.get("decode") != "eager":
        return "FAIL", f"decode modes {graph.last_report.get('decode')} / {eager.last_report.get('decode')}"
    verdict, detail = compare(e, gr, dtype)
    stop = SamplingParams(max_tokens=NEW, ignore_eos=True, stop_token_ids=[e[1][5]])
    e2 = [o.token_ids for o in eager.generate(ps, stop)]
    g2 = [o.token_ids for o in graph.generate(ps, stop)]
    v2, d2 = compare(e2, g2, dtype)
    worst = max((verdict, v2), key=("PASS", "WARN", "FAIL").index)
    return worst, f"{detail}; with a stop token (lengths {[len(x) for x in e2]}): {d2}"


def check_session(graph: Any, eager: Any, dtype: torch.dtype) -> tuple[str, str]:
    from megacp import SamplingParams

    ps = prompts(graph.model_config.vocab_size)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    outs = []
    for llm in (eager, graph):
        with llm.session() as chat:
            outs.append([chat.send(ps[1], params).token_ids, chat.send(ps[0], params).token_ids])
    return compare(outs[0], outs[1], dtype)


def check_sampled(graph: Any, eager: Any, dtype: torch.dtype) -> tuple[str, str]:
    from megacp import SamplingParams

    ps = prompts(graph.model_config.vocab_size)
    mixed = [SamplingParams(max_tokens=NEW // 2, ignore_eos=True),
             SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1),
             SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.1, top_k=30, min_p=0.02,
                            repetition_penalty=1.2, presence_penalty=0.2, frequency_penalty=0.3, seed=5)]
    e = [o.token_ids for o in eager.generate(ps, mixed)]
    gr = [o.token_ids for o in graph.generate(ps, mixed)]
    if graph.last_report.get("decode") != "cuda_graph":
        return "FAIL", f"decode mode {graph.last_report.get('decode')}"
    alone = graph.generate(ps[1], mixed[1])[0].token_ids
    verdict, detail = compare(e, gr, dtype)
    v2, d2 = compare([gr[1]], [alone], dtype)
    worst = max((verdict, v2), key=("PASS", "WARN", "FAIL").index)
    return worst, f"graph vs eager: {detail}; alone vs in the batch: {d2}"


def check_fp8(fp8: Any, auto: Any) -> tuple[str, str]:
    ps = prompts(fp8.model_config.vocab_size)
    logits: dict[str, list[torch.Tensor]] = {"fp8": [], "auto": []}
    with torch.inference_mode():
        runs = {kv: (llm.generator, *llm.generator.batch_cache(ps, 34)) for kv, llm in (("fp8", fp8), ("auto", auto))}
        for kv, (gen, cache, slots) in runs.items():
            logits[kv].append(gen.prefill(cache, slots, ps)[0])
        for _ in range(32):
            tok = logits["auto"][-1].argmax(-1)
            for kv, (gen, cache, slots) in runs.items():
                logits[kv].append(gen.decode_step(cache, slots, tok))
    a, b = torch.cat(logits["auto"]), torch.cat(logits["fp8"])
    rel = float((a - b).abs().max() / a.abs().max())
    differ = int((a.argmax(-1) != b.argmax(-1)).sum())
    verdict = "FAIL" if not rel <= FP8_TOL else "WARN" if differ else "PASS"
    return verdict, f"logits max diff {rel:.3f} of the largest (tol {FP8_TOL:g}), {differ} of {a.shape[0]} greedy tokens differ"


def main() -> int:
    import megacp
    from megacp import LLM

    parser = argparse.ArgumentParser(description="CUDA-graph decode against eager decode")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"))
    kv = parser.parse_args().kv_cache_dtype
    if not torch.cuda.is_available():
        print("SKIP: CUDA graphs need a CUDA GPU", flush=True)
        return 0
    state = megacp.initialize()
    rank = state.rank
    checks = Checks(rank)
    root = Path(tempfile.gettempdir()) / f"megacp_graph_check_{os.environ.get('MASTER_PORT', os.getpid())}"
    for name, spec in (("tiny", TINY), ("smollm2", MODELS["smollm2"])):
        from megacp.checkpoint.hf import config_from_hf
        from megacp.models import build_model

        path = root / name
        if rank == 0 and not path.exists():
            cfg = config_from_hf(spec)
            torch.manual_seed(0)
            model = build_model(cfg, dtype=torch.float32, device="cuda", backend="torch")
            hf_copy(model, cfg, torch.float32, torch.device("cuda")).save_pretrained(str(path))
            del model
        if state.world_size > 1:
            dist.barrier()
        for dtype in (torch.float32, torch.bfloat16):
            case = f"{name} {str(dtype).replace('torch.', '')} CP={state.size('cp')} KV {kv}"
            try:
                graph = LLM(str(path), dtype=dtype, cuda_graphs=True, state=state, kv_cache_dtype=kv)
                eager = LLM(str(path), dtype=dtype, cuda_graphs=False, state=state, kv_cache_dtype=kv)
                eager.generator.static_step = False  # eager steps, not the graph's step run eagerly
            except Exception as exc:  # noqa: BLE001
                checks.say("FAIL", f"{case} load", f"{type(exc).__name__}: {exc}")
                continue
            mc = graph.model_config
            checks.run(f"{case} kernel", check_kernel, dtype, mc.num_heads, mc.num_kv_heads, mc.head_dim)
            checks.run(f"{case} step", check_step, graph, dtype)
            checks.run(f"{case} generate", check_generate, graph, eager, dtype)
            checks.run(f"{case} session", check_session, graph, eager, dtype)
            checks.run(f"{case} sampled", check_sampled, graph, eager, dtype)
            if kv != "auto" and dtype == torch.bfloat16:
                checks.run(f"{case} fp8 kernel", check_fp8_kernel, mc.num_heads, mc.num_kv_heads, mc.head_dim)
            if kv != "auto":
                plain = LLM(str(path), dtype=dtype, cuda_graphs=False, state=state)
                plain.generator.static_step = False
                checks.run(f"{case} fp8", check_fp8, eager, plain)
                del plain
            del graph, eager
            torch.cuda.empty_cache()
    if rank == 0:
        print("ALL PASS" if checks.failed == 0 else f"FAILED: {checks.failed}", flush=True)
    if state.world_size > 1:
        dist.barrier()
    dist.destroy_process_group()
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
