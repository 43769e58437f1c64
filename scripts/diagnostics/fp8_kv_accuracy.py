"""How far an FP8 KV cache moves a model's logits from the unquantised cache's.

    python -m scripts.diagnostics.fp8_kv_accuracy                       # SmolLM2-135M-Instruct, fp32, CPU
    python -m scripts.diagnostics.fp8_kv_accuracy --model HF_DIR --dtype bfloat16
    torchrun --nproc_per_node 2 -m scripts.diagnostics.fp8_kv_accuracy  # CP = 2 (the same numbers: CP-exact)

Two generators share the loaded model, one per cache (``kv_cache_dtype`` ``auto`` and
``fp8_e4m3``). Both prefill the prompt (in chunks of ``--prefill-chunk``) and decode ``--steps``
steps fed the unquantised cache's greedy tokens, so every position compares. Rank 0 prints one JSON
line: the largest logit, the largest |difference| (and its mean over positions), each position's
difference and top-2 margin, how many greedy tokens differ, and both caches' free-running greedy
texts of ``--free-tokens`` tokens. DESIGN.md's numbers for SmolLM2 come from the defaults.
"""

from __future__ import annotations

import argparse
import json

import torch

from megacp import LLM, SamplingParams
from megacp.generate import Generator
from megacp.generate.engine import generate

PROMPT = ("The history of context parallelism begins with ring attention, where each device holds a block of the "
          "sequence and passes keys and values to its neighbour. Explain in three sentences why this helps long prompts.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct GGUF")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="teacher-forced decode steps")
    p.add_argument("--free-tokens", type=int, default=48, help="free-running greedy tokens of each cache")
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, prefill_chunk=args.prefill_chunk)
    ids = llm.token_ids(PROMPT)
    base = llm.generator
    gens = {kv: Generator.for_model(base.model, llm.model_config, base.settings, device=base.device, dtype=base.dtype,
                                    prefill_chunk=args.prefill_chunk, kv_cache_dtype=kv) for kv in ("auto", "fp8_e4m3")}
    logits: dict[str, list[torch.Tensor]] = {kv: [] for kv in gens}
    with torch.inference_mode():
        caches = {kv: gen.batch_cache([ids], args.steps + 1) for kv, gen in gens.items()}
        for kv, gen in gens.items():
            logits[kv].append(gen.prefill(*caches[kv], [ids])[0])
        for _ in range(args.steps):
            tok = logits["auto"][-1].argmax(-1)
            for kv, gen in gens.items():
                logits[kv].append(gen.decode_step(*caches[kv], tok))
    a, b = torch.cat(logits["auto"]), torch.cat(logits["fp8_e4m3"])
    diff = (a - b).abs().amax(-1)
    top2 = a.topk(2, dim=-1).values
    free = {kv: generate(gen, [ids], SamplingParams(max_tokens=args.free_tokens, ignore_eos=True),
                         vocab=llm.model_config.vocab_size).tokens[0] for kv, gen in gens.items()}
    texts = {kv: llm.tokenizer.decode(t) if llm.tokenizer is not None else t for kv, t in free.items()}
    if llm.state.rank == 0:
        print(json.dumps(dict(positions=a.shape[0], max_abs_logit=round(float(a.abs().max()), 4),
                              max_diff=round(float(diff.max()), 4), mean_max_diff=round(float(diff.mean()), 4),
                              diffs=[round(float(x), 4) for x in diff],
                              margins=[round(float(x), 4) for x in top2[:, 0] - top2[:, 1]],
                              greedy_differ=int((a.argmax(-1) != b.argmax(-1)).sum()),
                              free_running_identical=free["auto"] == free["fp8_e4m3"], texts=texts)), flush=True)


if __name__ == "__main__":
    main()
