"""The server's running-batch decode on the GPU: :class:`~megacp.generate.graph.BatchDecoder`
replaying CUDA graphs against the same step run eagerly and against ``LLM.generate``.

    python -m tests.programs.batch_decode_check                        # one GPU, CP = 1
    torchrun --nproc_per_node 2 -m tests.programs.batch_decode_check   # CP = 2 (NCCL collectives in the graphs)

A tiny random Llama (tests/helpers/hf_models.py), float32 and bfloat16. Twelve requests go through
a :class:`~megacp.generate.worker.Worker` of 4 slots as the server's engine drives it
(``tests/helpers/serving.py::drive``: newcomers join the running batch 1 to 3 a step, finished
requests leave, rows move, padded sizes 1, 2, 4), greedy and then mixed sampling settings (top-k,
top-p, repetition / presence penalties, seeds: graphs of several sampler features; some requests
ask for logprobs, computed after the replay from the graph's logits):

* ``graph = static eager``: identical tokens (the same kernels, replayed from graphs), logprobs
  within 1e-6.
* ``graph = generate``: identical tokens to ``LLM.generate`` of the same requests and logprobs
  within 1e-4 (float32: ``PASS``/``FAIL``; bfloat16: differences are ``WARN``, near-ties under
  other kernels' rounding).
* ``eager batch = generate``: the same for the eager batch (the eager model step in :class:`~megacp.generate.graph.BatchDecoder`).

Prints one ``PASS``/``FAIL``/``WARN`` line per check (rank 0) and ends with ``ALL PASS`` or
``FAILED: n``; exit status 0 / 1.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from tests.helpers.hf_models import make_hf_model, save_char_tokenizer
from tests.helpers.serving import drive as _drive
from tests.helpers.serving import logprobs_close
from tests.helpers.serving import prompts as _prompts


def main() -> int:
    import megacp
    from megacp import LLM, SamplingParams
    from megacp.generate.worker import Worker

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 1
    state = megacp.initialize(None)
    rank = state.rank
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        box = [tmp]
        if state.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if rank == 0:
            make_hf_model("llama3", box[0])
            save_char_tokenizer(box[0])
        if state.world_size > 1:
            dist.barrier()
        prompts = _prompts()[:12]
        kinds: list[dict] = [{}, dict(temperature=0.8, top_k=20), dict(repetition_penalty=1.3),
                             dict(top_p=0.9, presence_penalty=0.5)]
        for dtype in ("float32", "bfloat16"):
            llm = LLM(box[0], dtype=dtype, state=state)
            for name, params in (("greedy", [SamplingParams(max_tokens=2 + i % 7, ignore_eos=True) for i in range(12)]),
                                 ("mixed", [SamplingParams(max_tokens=2 + i % 7, seed=i, ignore_eos=True,
                                                           logprobs=(None, 2, 0)[i % 3], **kinds[i % 4])
                                            for i in range(12)])):
                outs = llm.generate(prompts, params)
                ref, ref_logprobs = [o.token_ids for o in outs], [o.logprobs for o in outs]
                got = {}
                for mode, static, capture in (("graph", True, True), ("static eager", True, False),
                                              ("eager batch", False, False)):
                    worker = Worker(llm.generator, 4, 64, vocab=llm.model_config.vocab_size, static=static,
                                    capture=capture)
                    got[mode] = _drive(worker, prompts, params)
                    del worker
                checks = [("graph = static eager", got["graph"][0] == got["static eager"][0]
                           and logprobs_close(got["graph"][1], got["static eager"][1], 1e-6), True),
                          ("graph = generate", got["graph"][0] == ref
                           and logprobs_close(got["graph"][1], ref_logprobs, 1e-4), dtype == "float32"),
                          ("eager batch = generate", got["eager batch"][0] == ref
                           and logprobs_close(got["eager batch"][1], ref_logprobs, 1e-4), dtype == "float32")]
                for what, ok, strict in checks:
                    verdict = "PASS" if ok else "FAIL" if strict else "WARN"
                    failed += verdict == "FAIL"
                    if rank == 0:
                        print(f"{verdict} {dtype} {name}: {what}", flush=True)
            del llm
    if rank == 0:
        print("ALL PASS" if not failed else f"FAILED: {failed}", flush=True)
    if state.world_size > 1:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
