"""Mixture-of-experts models (Mixtral, Qwen2-MoE) with experts sharded over megacp's EP groups.

Generation at CP 1/2 x EP 1/2 (EP over dp, over dp x cp, and over tp) equals transformers' greedy
tokens on a ragged batch, whole and chunked prefill; the all-to-all dispatch delivers every token
copy to the rank that owns its expert (counts against transformers' own router top-k); checkpoints
convert HF -> megacp -> HF bit for bit; the mpu names the expert groups; training with every expert on
every rank under CP (x TP) equals CP = 1, and so does training with the experts sharded over EP under
DeepSpeed (ZeRO 0 / 1 / 2); GGUF MoE files and bad sizes get one clear line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tests.helpers.distributed import ROOT, run_distributed
from tests.helpers.hf_models import hf_greedy, make_hf_model

if TYPE_CHECKING:
    from megacp.models import ModelConfig

MOE_KINDS = ("mixtral", "qwen2_moe")
NEW_TOKENS = 5
PROMPT_LENS = (29, 1, 18)  # a ragged batch; alone, the 1-token prompt leaves CP rank 1 without tokens
CHUNK = 8  # chunked prefill: later chunks attend a sharded cache


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)  # no greedy EOS (transformers suppresses it below min_new_tokens)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _router_counts(hf: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """Token copies per expert of each MoE layer over all prompts, from transformers' router logits."""
    totals = None
    for prompt in prompts:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt]), output_router_logits=True).router_logits
        k = hf.config.num_experts_per_tok
        counts = [torch.bincount(torch.topk(torch.softmax(layer.float(), -1), k, -1).indices.reshape(-1),
                                 minlength=layer.shape[-1]) for layer in logits]
        totals = counts if totals is None else [a + b for a, b in zip(totals, counts)]
    return [t.tolist() for t in totals]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """kind -> checkpoint dir, the same as a megacp checkpoint of TP size 2, transformers' greedy
    tokens and router counts of the prompts."""
    from megacp.checkpoint.convert import main

    out = {}
    for kind in MOE_KINDS:
        directory = tmp_path_factory.mktemp(kind)
        hf = make_hf_model(kind, directory)
        megacp_dir = tmp_path_factory.mktemp(f"{kind}_megacp_tp2") / "checkpoint"
        assert main(["hf-to-megacp", "--input", str(directory), "--output", str(megacp_dir), "--tp", "2"]) == 0
        out[kind] = dict(path=str(directory), megacp_path=str(megacp_dir), tokens=hf_greedy(hf, _prompts(), NEW_TOKENS),
                         counts=_router_counts(hf, _prompts()))
    return out


def _generate(rank: int, world: int, paths: list[str], prompts: list[list[int]], new: int, config: dict) -> dict:
    """Per model: greedy tokens (whole and chunked prefill, and of the 1-token prompt alone) and, for
    one prefill of the whole batch, this rank's first expert and token copies per local expert of
    each MoE layer."""
    import megacp
    from megacp.checkpoint import load_model
    from megacp.generate import Generator, SamplingParams
    from megacp.generate.engine import generate
    from megacp.layers.settings import CPSettings
    from megacp.models.build import expert_parallel_group
    from megacp.models.moe import MoEMLP
    from megacp.parallel.ring import Ring

    state = megacp.initialize(config)
    ring = Ring(state.group("cp")) if state.size("cp") > 1 else None
    tp = state.size("tp")
    out = {}
    for path in paths:
        model, cfg, _ = load_model(path, dtype=torch.float32, device="cpu", tp_group=state.group("tp") if tp > 1 else None,
                                   ep_group=expert_parallel_group(state))
        megacp.swap_attention(model, state)
        moe = [m for m in model.modules() if isinstance(m, MoEMLP)]

        def run(chunk: int, tokens: int, batch: list[list[int]] = prompts) -> list[list[int]]:  # called in this iteration only
            gen = Generator.for_model(model, cfg, CPSettings(ring=ring), device=torch.device("cpu"),  # noqa: B023
                                      dtype=torch.float32, tp_size=tp, prefill_chunk=chunk)
            return generate(gen, batch, SamplingParams(max_new_tokens=tokens), vocab=cfg.vocab_size).tokens  # noqa: B023

        whole, chunked, alone = run(0, new), run(CHUNK, new), run(0, new, prompts[1:2])
        for m in moe:
            m.expert_tokens.zero_()
        run(0, 1)  # one prefill step, no decode
        out[path] = dict(whole=whole, chunked=chunked, alone=alone, first=moe[0].first_expert,
                         counts=[m.expert_tokens.tolist() for m in moe])
    return out


CASES = {
    # name: (world size, megacp config sections, ranks that hold the same tokens); the TP case loads
    # the TP-sharded megacp checkpoints, the others the Hugging Face directories
    "cp1_ep1": (1, {}, 1),
    "cp2_ep1": (2, {"context_parallel": {"size": 2}}, 1),
    "cp1_ep2": (2, {"expert_model_parallel": {"size": 2}}, 2),
    "cp2_ep2": (4, json.loads((ROOT / "configs" / "cp2_ep2_moe.json").read_text()), 2),  # the shipped config
    "cp2_ep4_include_cp": (4, {"context_parallel": {"size": 2}, "expert_model_parallel": {"size": 4, "include_cp": True}}, 2),
    "cp2_tp2_ep2": (4, {"context_parallel": {"size": 2}, "tensor_model_parallel": {"size": 2},
                        "expert_model_parallel": {"size": 2}}, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generation_equals_transformers_and_dispatch_reaches_owners(case: str, moe_models: dict) -> None:
    world, config, replicas = CASES[case]
    paths = [moe_models[k]["megacp_path" if "tensor_model_parallel" in config else "path"] for k in MOE_KINDS]
    results = run_distributed(_generate, world, paths, _prompts(), NEW_TOKENS, config)
    ep = config.get("expert_model_parallel", {}).get("size") or 1
    for kind, path in zip(MOE_KINDS, paths):
        expected = moe_models[kind]
        for rank_result in results:
            got = rank_result[path]
            assert got["whole"] == expected["tokens"], (case, kind, "whole")
            assert got["chunked"] == expected["tokens"], (case, kind, "chunked")
            assert got["alone"] == expected["tokens"][1:2], (case, kind, "alone")
        # Each rank counts only the experts it owns; summed over the owners of each expert, the copies
        # equal the router's top-k over the whole batch, once per replica of the batch.
        local = 4 // ep
        assert sorted({r[path]["first"] for r in results}) == list(range(0, 4, local)), (case, kind)
        received = [[0] * 4 for _ in expected["counts"]]
        for rank_result in results:
            got = rank_result[path]
            for layer, counts in enumerate(got["counts"]):
                assert len(counts) == local
                for j, c in enumerate(counts):
                    received[layer][got["first"] + j] += c
        assert received == [[replicas * c for c in layer] for layer in expected["counts"]], (case, kind)


# --------------------------------------------------------------------------- checkpoints, errors


def test_hf_to_megacp_to_hf_round_trip_is_exact(moe_models: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from megacp.checkpoint.convert import main

    for kind in MOE_KINDS:  # the megacp checkpoint (TP size 2) was converted from the HF one by the fixture
        source = Path(moe_models[kind]["path"])
        assert main(["megacp-to-hf", "--input", moe_models[kind]["megacp_path"], "--output", str(tmp_path / f"{kind}_hf")]) == 0
        before, after = load_file(source / "model.safetensors"), load_file(tmp_path / f"{kind}_hf" / "model.safetensors")
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), kind
        config = json.loads((tmp_path / f"{kind}_hf" / "config.json").read_text())
        original = json.loads((source / "config.json").read_text())
        keys = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step")
        assert {k: config[k] for k in keys if k in original} == {k: original[k] for k in keys if k in original}


def test_gguf_mixture_of_experts_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import gguf
    import numpy as np

    from megacp.checkpoint.convert import main

    writer = gguf.GGUFWriter(str(tmp_path / "mixtral.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["gguf-to-megacp", "--input", str(tmp_path / "mixtral.gguf"), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        "error: GGUF mixture-of-experts models (llama, 4 experts) are not supported; "
        "convert the Hugging Face checkpoint instead\n"
    )
    assert not (tmp_path / "out").exists()


def test_bad_expert_parallel_sizes_get_one_clear_line(moe_models: dict) -> None:
    from megacp.checkpoint import CheckpointError
    from megacp.checkpoint.hf import open_hf_checkpoint
    from megacp.checkpoint.tp import check_ep_rank
    from megacp.models import ModelConfig

    with open_hf_checkpoint(moe_models["mixtral"]["path"]) as checkpoint:
        mixtral = checkpoint.config
    with pytest.raises(CheckpointError, match=r"^num_experts=4 is not divisible by the expert-parallel size 3$"):
        check_ep_rank(mixtral, 0, 3)
    dense = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    with pytest.raises(CheckpointError, match=r"^expert_model_parallel.size: got 2; the llama model has no expert "
                                              r"layers; allowed values: 1 or null$"):
        check_ep_rank(dense, 0, 2)


def _expert_groups(rank: int, world: int, config: dict) -> dict:
    import torch.distributed as dist

    import megacp
    from megacp.parallel.mpu import DeepSpeedMPU

    mpu = DeepSpeedMPU(megacp.initialize(config))
    out = {}
    for prefix in ("expert_parallel", "expert_data_parallel"):
        group = getattr(mpu, f"get_{prefix}_group")()
        members = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, torch.tensor([rank]), group=group)
        out[prefix] = (getattr(mpu, f"get_{prefix}_world_size")(), getattr(mpu, f"get_{prefix}_rank")(),
                       [int(m) for m in members])
    return out


@pytest.mark.parametrize("include_cp", [False, True])
def test_mpu_expert_groups_dp2_cp2(include_cp: bool) -> None:
    """rank = dp·2 + cp: experts are sharded over dp (or dp x cp); the cp ranks (or nobody) hold the same ones."""
    config = {"context_parallel": {"size": 2}, "expert_model_parallel": {"size": 4 if include_cp else 2,
                                                                         "include_cp": include_cp}}
    for rank, out in enumerate(run_distributed(_expert_groups, 4, config)):
        dp, cp = divmod(rank, 2)
        if include_cp:
            assert out == {"expert_parallel": (4, rank, [0, 1, 2, 3]), "expert_data_parallel": (1, 0, [rank])}
        else:
            assert out == {"expert_parallel": (2, dp, [cp, cp + 2]), "expert_data_parallel": (2, cp, [2 * dp, 2 * dp + 1])}


# --------------------------------------------------------------------------------------- training


def _moe_config() -> ModelConfig:
    """Qwen2-MoE without Q/K/V bias: a key bias's exact gradient is 0 (it shifts all of a query's
    scores alike), and AdamW would turn its rounding noise into CP-dependent updates."""
    from megacp.models import ModelConfig

    return ModelConfig(architecture="qwen2_moe", vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=3,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=64, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
                       shared_expert_intermediate_size=40, mlp_only_layers=[1])


def _train_worker(rank: int, world: int, cp: int, tp: int) -> dict:
    from megacp import swap_attention
    from megacp.layers.settings import CPSettings
    from megacp.parallel.layout import ParallelLayout
    from megacp.parallel.state import ParallelState
    from tests.helpers.training import seeded_model, train_steps

    state = ParallelState.build(ParallelLayout(cp=cp, tp=tp))
    model = seeded_model(_moe_config(), state.group("tp") if tp > 1 else None)
    settings = CPSettings.from_state(state)
    swap_attention(model, settings)
    losses, _, first = train_steps(model, cp, state.rank_in("cp"), state.group("cp"), check_recompute=True, settings=settings)
    return dict(losses=losses, first=first, tp_rank=state.rank_in("tp"),
                params={n: p.detach() for n, p in model.state_dict().items()})


@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (2, 2)], ids=["cp2", "cp2xtp2"])
def test_moe_training_under_cp_equals_single_process(cp: int, tp: int) -> None:
    """20 AdamW steps (router, experts and shared expert included) at CP 2 (x TP 2, every rank
    holding every expert) give CP = 1's losses and parameters (tolerances of test_train_equivalence)."""
    from megacp.checkpoint.tp import is_replicated, merge_shards
    from tests.helpers.reference import rel_err
    from tests.helpers.training import ELEMENT_RTOL, RTOL, seeded_model, train_steps

    torch.set_num_threads(1)
    reference = seeded_model(_moe_config())
    ref_losses, _, _ = train_steps(reference, 1, 0, None)
    results = run_distributed(_train_worker, cp * tp, cp, tp)
    for res in results:
        assert rel_err(torch.tensor(res["losses"], dtype=torch.float64),
                       torch.tensor(ref_losses, dtype=torch.float64)) <= RTOL, (res["losses"], ref_losses)
    group = sorted(results[:tp], key=lambda r: r["tp_rank"])  # the TP ranks of CP rank 0
    for name, grad in group[0]["first"].items():
        if is_replicated(name):  # router and experts too: one full gradient on every TP rank
            assert all(rel_err(other["first"][name], grad) <= 1e-6 for other in group[1:]), name
    for name, want in reference.state_dict().items():
        got = merge_shards(_moe_config(), name, [r["params"][name] for r in group])
        norm_err = float((got - want).norm() / want.norm())
        assert norm_err <= RTOL and rel_err(got, want) <= ELEMENT_RTOL, (name, norm_err, rel_err(got, want))
    start = seeded_model(_moe_config()).state_dict()
    assert rel_err(reference.state_dict()["layers.0.moe.router_weight"], start["layers.0.moe.router_weight"]) > 1e-2


# ------------------------------------------------------------- training with experts sharded over EP

EP_STEPS = 20
EP_LR = 2e-3
EP_CLIP = 0.05  # small enough that clipping acts on every step
EP_SEQ_LEN = 24
EP_RUNS = {
    # name: (model kind, megacp mesh sections, ZeRO stage, gradient clipping)
    "zero0": ("qwen2_moe", {"expert_model_parallel": {"size": 2}}, 0, 0.0),
    "zero1": ("qwen2_moe", {"expert_model_parallel": {"size": 2}}, 1, EP_CLIP),
    "zero2": ("qwen2_moe", {"expert_model_parallel": {"size": 2}}, 2, EP_CLIP),
    "zero1_include_cp": ("mixtral", {"expert_model_parallel": {"size": 4, "include_cp": True}}, 1, EP_CLIP),
    "zero1_tp2": ("qwen2_moe", {"context_parallel": {"size": 1}, "tensor_model_parallel": {"size": 2},
                                "expert_model_parallel": {"size": 4}}, 1, EP_CLIP),
}


def _ep_model_config(kind: str) -> ModelConfig:
    from dataclasses import replace

    cfg = replace(_moe_config(), num_layers=2, mlp_only_layers=[])
    return cfg if kind == "qwen2_moe" else replace(cfg, architecture="mixtral", norm_topk_prob=True,
                                                   shared_expert_intermediate_size=0)


def _ep_batches() -> list:
    """``EP_STEPS x 2`` packed sequences of ragged documents: step s gives DP replica d sequence 2s + d."""
    from megacp.train.data import pack_documents

    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 80, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (60,), generator=g)]
    packed = list(pack_documents(docs, EP_SEQ_LEN))
    assert len(packed) >= 2 * EP_STEPS
    return packed[: 2 * EP_STEPS]


def _ep_reference(kind: str, clip: float) -> dict:
    """One process, every expert, plain ``torch.optim.AdamW``: per step the mean of the two DP
    replicas' losses is differentiated (DeepSpeed's average over DP), clipped, and stepped. Returns
    the losses, the gradient norms before clipping, step 0's gradients and the final parameters."""
    from megacp.models.loss import lm_loss
    from megacp.placement.batch import shard_batch
    from tests.helpers.training import seeded_model

    model = seeded_model(_ep_model_config(kind)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=EP_LR, weight_decay=0.01)
    batches, losses, norms, first = _ep_batches(), [], [], {}
    for step in range(EP_STEPS):
        replica = [lm_loss(model, shard_batch(b.input_ids, cu_seqlens=b.cu_seqlens, cp_size=1, cp_rank=0))
                   for b in batches[2 * step: 2 * step + 2]]
        loss = sum(replica) / 2
        loss.backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return dict(losses=losses, norms=norms, first=first, params={n: p.detach().clone() for n, p in model.state_dict().items()})


def _ep_train_worker(rank: int, world: int) -> dict:
    """Per run of :data:`EP_RUNS`: the losses, DeepSpeed's gradient norm of each step (clipped
    runs), step 0's reduced gradients (ZeRO 0, which keeps them in ``.grad`` until the optimizer
    step) and the final parameters of this rank."""
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported: no accelerator probing
    import megacp
    from megacp.checkpoint.tp import shard_experts, shard_tensor
    from megacp.models import CausalLM
    from megacp.models.build import expert_parallel_group
    from megacp.models.loss import lm_loss
    from megacp.placement.batch import shard_batch
    from megacp.train.engine import Trainer
    from tests.helpers.training import seeded_model

    torch.set_num_threads(1)
    out = {}
    for name, (kind, mesh, stage, clip) in EP_RUNS.items():
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
                  "steps_per_print": 10**6, "zero_optimization": {"stage": stage}, "context_parallel": {"size": 2},
                  "optimizer": {"type": "AdamW", "params": {"lr": EP_LR, "weight_decay": 0.01, "torch_adam": True}},
                  **mesh}
        state = megacp.initialize(config)
        cfg, ep_group = _ep_model_config(kind), expert_parallel_group(state)
        ep_rank, ep_size, tp_rank, tp = state.rank_in("ep"), state.size("ep"), state.rank_in("tp"), state.size("tp")
        model = CausalLM(cfg, state.group("tp") if tp > 1 else None, ep_group, dtype=torch.float32).train()
        model.load_state_dict({n: shard_experts(n, shard_tensor(cfg, n, t, tp_rank, tp), ep_rank, ep_size).clone()
                               for n, t in seeded_model(cfg).state_dict().items()})
        megacp.swap_attention(model, state, strategy="pass_kv")
        trainer = Trainer(model, config, state)
        dp, first = state.rank_in("dp"), {}
        if stage == 0:
            batch = _ep_batches()[dp]
            trainer.engine.backward(lm_loss(model, shard_batch(batch.input_ids, cu_seqlens=batch.cu_seqlens,
                                                               cp_size=state.size("cp"), cp_rank=state.rank_in("cp")),
                                           settings=trainer.cp))
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
        batches = iter(_ep_batches()[dp::2])
        losses, norms = [], []
        for _ in range(EP_STEPS):
            losses.append(trainer.step(batches).loss)
            norms.append(float(trainer.engine.get_global_grad_norm()) if clip else None)
        out[name] = dict(losses=losses, norms=norms, first=first, ep_rank=ep_rank, tp_rank=tp_rank,
                         params={n: p.detach().clone() for n, p in model.state_dict().items()})
    return out


def _gather(kind: str, name: str, by_ep: dict[int, dict], by_tp: dict[int, dict]) -> torch.Tensor:
    """The full tensor ``name`` from the ranks' parts: experts from the EP ranks, the rest merged
    over the TP ranks."""
    from megacp.checkpoint.tp import merge_shards

    if "expert_fc" in name:
        return torch.cat([by_ep[e][name] for e in sorted(by_ep)])
    return merge_shards(_ep_model_config(kind), name, [by_tp[t][name] for t in sorted(by_tp)])


def test_sharded_expert_training_under_deepspeed_equals_single_process() -> None:
    """20 AdamW steps at CP 2 x DP 2 with the experts sharded over EP (over dp: EP 2, ZeRO 0 / 1 / 2;
    over dp x cp: EP 4, ZeRO 1) and at TP 2 x DP 2 (EP 4 over dp x tp, ZeRO 1), through megacp's
    Trainer under DeepSpeed, give the losses and the parameters (experts gathered back from their EP
    ranks; router and shared expert included) of one process holding every expert (fp32, the
    tolerances of test_train_equivalence: losses 1e-5 relative, parameters 1e-5 relative in norm
    and 1e-4 in their worst element). AdamW hardly sees a gradient's scale, so the scale is checked
    directly: ZeRO 0's reduced gradients of step 0 (every expert summed over CP, averaged over DP)
    and, with clipping (ZeRO 1 / 2, acting on every step), DeepSpeed's gradient norm of every step
    (every expert counted once, on every TP rank) equal the single process's within 1e-5."""
    pytest.importorskip("deepspeed", reason="DeepSpeed not installed")
    from tests.helpers.reference import rel_err
    from tests.helpers.training import ELEMENT_RTOL, RTOL, seeded_model

    torch.set_num_threads(1)
    results = run_distributed(_ep_train_worker, 4)
    references, errors = {}, {}
    for name, (kind, _, stage, clip) in EP_RUNS.items():
        if (kind, clip) not in references:
            references[kind, clip] = _ep_reference(kind, clip)
        ref = references[kind, clip]
        runs = [res[name] for res in results]
        by_ep = {run["ep_rank"]: run for run in reversed(runs)}
        by_tp = {run["tp_rank"]: run for run in reversed(runs)}
        for run in runs:
            assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), (name, run["losses"], ref["losses"])
            if clip:
                assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5), (name, run["norms"], ref["norms"])
                assert min(ref["norms"]) > clip  # clipping acts on every step
            for n in run["params"]:  # ranks holding the same experts hold the same values
                assert torch.equal(run["params"][n], by_ep[run["ep_rank"]]["params"][n]), (name, n)
        if stage == 0:
            grads = ({e: r["first"] for e, r in by_ep.items()}, {t: r["first"] for t, r in by_tp.items()})
            for n, want in ref["first"].items():
                assert rel_err(_gather(kind, n, *grads), want) <= 1e-5, (name, n, rel_err(_gather(kind, n, *grads), want))
        params = ({e: r["params"] for e, r in by_ep.items()}, {t: r["params"] for t, r in by_tp.items()})
        for n, want in ref["params"].items():
            got = _gather(kind, n, *params)
            norm_err = float((got - want).norm() / want.norm())
            errors[name] = max(errors.get(name, 0.0), norm_err)
            assert norm_err <= RTOL and rel_err(got, want) <= ELEMENT_RTOL, (name, n, norm_err, rel_err(got, want))
    print("worst parameter error in norm per run:", errors)
    start = seeded_model(_ep_model_config("qwen2_moe")).state_dict()
    for n in ("layers.0.moe.router_weight", "layers.0.moe.expert_fc1_weight"):  # the weights moved
        assert rel_err(references["qwen2_moe", 0.0]["params"][n], start[n]) > 1e-2, n
