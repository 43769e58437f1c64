"""transformers models trained over query tiles (:func:`megacp.integrations.hf_memory.tile_attention`)
on real gloo processes at CP 1, 2 and 3 (fp32): a Llama, a Qwen3 (q/k norms) and a Mistral whose
window (4 tokens) is shorter than its documents, with tiles of 4 query rows alone and with every
other memory feature (fused norms, the tiled MLP, both layers one checkpoint block with its input on
the host, the tiled loss): the loss and every parameter's gradient (summed over the CP ranks, as
training reduces them) equal the model's own untiled step's (<= 2e-6 relative, :data:`RTOL`). A Phi-3 (fused qkv, another layer formula) keeps its layers untiled."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.hf_archs import DOCS, SMALL, make_model, packed_batch

ARCHS = {"llama": {}, "qwen3": {}, "mistral": dict(sliding_window=4)}
RTOL = 2e-6
"""The tiled step sums each gradient in another order than the untiled one (per tile of queries, as a
CP rank does per shard): fp32 rounds the two differently by up to ~1.0e-6 of a gradient's norm here
(the worst parameter, a Qwen3 q_proj at CP 1; megacp's CP equivalence tests allow 1e-5)."""


def _grads(rank: int, world: int) -> dict[str, float]:
    import megacp
    from megacp.integrations import hf_memory
    from megacp.integrations.transformers import shard_loss
    from megacp.layers.settings import CPSettings
    from megacp.models.checkpointing import HostStash
    from megacp.placement.batch import shard_batch

    state = megacp.initialize()
    settings = CPSettings.from_state(state, prefill="pass_kv") if world > 1 else None
    ids, _, _ = packed_batch(seed=2)
    cu = torch.tensor([0, *DOCS]).cumsum(0).tolist()
    shard = shard_batch(ids.reshape(-1), None, cu_seqlens=cu, cp_size=world, cp_rank=rank)
    errors: dict[str, float] = {}
    for arch, extra in ARCHS.items():
        base = make_model(arch, **extra)
        base.set_attn_implementation("megacp")
        base.train()

        def run(model: torch.nn.Module, loss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
            model.zero_grad()
            value = loss(model, shard, settings=settings)
            value.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            for g in grads.values():  # the gradient training takes: summed over the CP ranks
                torch.distributed.all_reduce(g)
            torch.distributed.all_reduce(value := value.detach())
            return value, grads

        ref_loss, ref_grads = run(base, shard_loss)
        for variant in ("alone", "all"):
            model = copy.deepcopy(base)
            tiling = hf_memory.tile_attention(model, 4)
            assert tiling.layers == SMALL["num_hidden_layers"]
            if variant == "all":
                hf_memory.fuse_norms(model)
                hf_memory.tile_mlps(model, 3)
                hf_memory.checkpoint_layers(model, hf_memory.LayerCheckpoints(2, frozenset({0}), HostStash(torch.device("cpu"))))
            loss, grads = run(model, hf_memory.tiled_loss if variant == "all" else shard_loss)
            assert grads.keys() == ref_grads.keys()
            worst = max(float((grads[k] - g).norm() / g.norm().clamp_min(1e-30)) for k, g in ref_grads.items())
            errors[f"{arch}/{variant}/loss"] = float((loss - ref_loss).abs() / ref_loss.abs())
            errors[f"{arch}/{variant}/grad"] = worst
    phi = make_model("phi3")
    errors["phi3/tiled layers"] = float(hf_memory.tile_attention(phi, 2).layers)
    megacp.shutdown()
    return errors


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tiled_attention_leaves_losses_and_gradients_unchanged(world: int) -> None:
    for rank, errors in enumerate(run_distributed(_grads, world)):
        bad = {k: v for k, v in errors.items() if v > RTOL}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errors) == 4 * len(ARCHS) + 1
