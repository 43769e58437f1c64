"""How far an FP8 KV cache moves a model's logits from the unquantised cache's.

    python -m scripts.diagnostics.fp8_kv_accuracy                       # SmolLM2-135M-Instruct, fp32, CPU
    python -m scripts.diagnostics.fp8_kv_accuracy --model HF_DIR --dtype bfloat16
    torchrun --nproc_per_node 2 -m scripts.diagnostics.fp8_kv_accuracy  # CP = 2 (the same numbers: CP-exact)
    python -m scripts.diagnostics.fp8_kv_accuracy --shape llama8b --layers 32 --dtype bfloat16 \
        --prompt-tokens 512 --json out.json                             # random weights of a benchmark shape

Two generators share the loaded model, one per cache (``kv_cache_dtype`` ``auto`` and
``fp8_e4m3``). Both prefill the prompt (in chunks of ``--prefill-chunk``) and decode ``--steps``
steps fed the unquantised cache's greedy tokens, so every position compares. Rank 0 prints one JSON
line (and writes it to ``--json``): the largest logit, the largest |difference| (and its mean over
positions), each position's difference and top-2 margin, how many greedy tokens differ and how many
of those differ where the unquantised top-2 margin exceeds twice that position's largest |difference|
(``greedy_differ_beyond_bound``: 0 when every flip is a near-tie the FP8 error explains), and both
caches' free-running greedy tokens (texts with a tokenizer) of ``--free-tokens`` tokens. With
``--shape`` the model is a benchmark shape (``scripts/bench/decode_hf.py``'s ``MODELS``) with random
weights and the prompt ``--prompt-tokens`` random ids. DESIGN.md's numbers for SmolLM2 come from the
defaults.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from megacp import LLM, SamplingParams
from megacp.checkpoint.dtypes import DTYPES
from megacp.generate import Generator
from megacp.generate.engine import generate

PROMPT = ("The history of context parallelism begins with ring attention, where each device holds a block of the "
          "sequence and passes keys and values to its neighbour. Explain in three sentences why this helps long prompts.")


def random_model(shape: str, layers: int | None, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, Any, Any]:
    """A CP-swapped megacp model of benchmark shape ``shape`` (``layers`` of them) with random
    weights: (model, config, CP settings, parallel state)."""
    import megacp
    from megacp.checkpoint.hf import config_from_hf
    from megacp.layers.settings import CPSettings
    from megacp.models import build_model
    from scripts.bench.decode_hf import MODELS

    state = megacp.initialize()
    hf = dict(MODELS[shape], **({"num_hidden_layers": layers} if layers else {}))
    cfg = config_from_hf(hf)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype, device=state.device, backend="torch")
    settings = CPSettings.from_state(state)
    megacp.swap_attention(model, settings)
    return model, cfg, settings, state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct GGUF")
    p.add_argument("--shape", default=None, help="instead of --model: a benchmark shape with random weights")
    p.add_argument("--layers", type=int, default=None, help="with --shape: its layers (default: the shape's)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="with --shape: random prompt ids")
    p.add_argument("--json", default=None, help="also write the JSON line here")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--steps", type=int, default=32, help="teacher-forced decode steps")
    p.add_argument("--free-tokens", type=int, default=48, help="free-running greedy tokens of each cache")
    args = p.parse_args()
    if args.shape:
        dtype = DTYPES[args.dtype]
        model, cfg, settings, state = random_model(args.shape, args.layers, dtype)
        tokenizer, device, rank = None, state.device, state.rank
        ids = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    else:
        llm = LLM(args.model, dtype=args.dtype, prefill_chunk=args.prefill_chunk)
        ids, tokenizer, rank = llm.token_ids(PROMPT), llm.tokenizer, llm.state.rank
        model, cfg, settings = llm.generator.model, llm.model_config, llm.generator.settings
        device, dtype = llm.generator.device, llm.generator.dtype
    gens = {kv: Generator.for_model(model, cfg, settings, device=device, dtype=dtype, prefill_chunk=args.prefill_chunk,
                                    kv_cache_dtype=kv) for kv in ("auto", "fp8_e4m3")}
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
                         vocab=cfg.vocab_size).tokens[0] for kv, gen in gens.items()}
    texts = {kv: tokenizer.decode(t) if tokenizer is not None else t for kv, t in free.items()}
    margins = top2[:, 0] - top2[:, 1]
    differ = a.argmax(-1) != b.argmax(-1)
    if rank == 0:
        line = json.dumps(dict(model=args.shape or args.model, layers=args.layers, dtype=args.dtype,
                               prompt_tokens=len(ids), positions=a.shape[0],
                               max_abs_logit=round(float(a.abs().max()), 4),
                               max_diff=round(float(diff.max()), 4), mean_max_diff=round(float(diff.mean()), 4),
                               diffs=[round(float(x), 4) for x in diff], margins=[round(float(x), 4) for x in margins],
                               greedy_differ=int(differ.sum()),
                               greedy_differ_beyond_bound=int((differ & (margins > 2 * diff)).sum()),
                               positions_beyond_bound=int((margins > 2 * diff).sum()),
                               free_running_identical=free["auto"] == free["fp8_e4m3"], texts=texts))
        print(line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
