"""GPU check of layers trained over query tiles (:mod:`megacp.models.tiled_layer`) in bf16: megacp's
Llama and transformers' ``LlamaForCausalLM`` (``attn_implementation="megacp"``) of Llama-3.1-8B's
layer shape, CP 1, one packed sequence; the loss and every gradient with the layers over query tiles
against the same step untiled (both with checkpointed layers), for scale the untiled step on flash's
kernels against cuDNN's, and each step's peak GPU memory beyond the model.

    python tests/programs/tiled_layer_check.py --layers 2 --tokens 32768 --tile 8192 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in b)


def run(args: argparse.Namespace) -> dict:
    import megacp
    from megacp.integrations import hf_memory
    from megacp.layers.settings import CPSettings
    from megacp.models import CausalLM
    from megacp.models.loss import lm_loss
    from megacp.placement.batch import shard_batch
    from scripts.bench.train_step import hf_model, model_config

    device = torch.device("cuda")
    cfg = model_config(args.layers)
    cfg.max_position_embeddings = 1 << 22
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=g)
    shard = shard_batch(ids, None, cu_seqlens=[0, args.tokens], cp_size=1, cp_rank=0)
    out: dict = {"tokens": args.tokens, "tile": args.tile, "layers": args.layers,
                 "gpu": torch.cuda.get_device_name(device)}

    def step(model: torch.nn.Module, loss_fn) -> tuple[float, dict[str, torch.Tensor], float]:  # noqa: ANN001
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = loss_fn(model)
        loss.backward()
        torch.cuda.synchronize()
        return float(loss), _grads(model), (torch.cuda.max_memory_allocated() - base) / 2**30

    megacp.initialize()
    torch.manual_seed(0)
    own = CausalLM(cfg, dtype=torch.bfloat16, device=device).train()
    own.activation_checkpointing = True
    megacp.swap_attention(own)
    rows = {}
    for name, backend, tile in (("untiled", "cudnn", 0), ("tiled", "cudnn", args.tile), ("flash", "flash", 0)):
        for layer in own.layers:
            layer.attention_tile = tile
        settings = CPSettings(backend=backend)
        rows[name] = step(own, lambda m, s=settings: lm_loss(m, shard, settings=s))
    out["megacp"] = {"loss_untiled": rows["untiled"][0], "loss_tiled": rows["tiled"][0],
                     "grad_rel_tiled_vs_untiled": _rel(rows["tiled"][1], rows["untiled"][1]),
                     "grad_rel_flash_vs_cudnn_untiled (bf16 noise)": _rel(rows["flash"][1], rows["untiled"][1]),
                     "peak_gib_untiled": rows["untiled"][2], "peak_gib_tiled": rows["tiled"][2]}
    del own, rows
    torch.cuda.empty_cache()

    hf = hf_model(cfg, "megacp")
    hf_memory.fuse_norms(hf)
    tiling = hf_memory.tile_attention(hf, 0)
    hf_memory.checkpoint_layers(hf, hf_memory.LayerCheckpoints())
    rows = {}
    for tile in (0, args.tile):
        tiling.tile = tile
        rows[tile] = step(hf, lambda m: hf_memory.tiled_loss(m, shard))
    out["hf"] = {"loss_untiled": rows[0][0], "loss_tiled": rows[args.tile][0],
                 "grad_rel_tiled_vs_untiled": _rel(rows[args.tile][1], rows[0][1]),
                 "peak_gib_untiled": rows[0][2], "peak_gib_tiled": rows[args.tile][2], "tiled_layers": tiling.layers}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--tile", type=int, default=8192)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = run(args)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
