"""GPU check of the Transformer Engine swap (needs TE and 2 GPUs; docs/GPU_FACTS.md says how TE runs there).

    torchrun --nproc_per_node 2 tests/programs/te_swap_check.py

A user's model built from real ``te.TransformerLayer``s (TE's own DotProductAttention and RoPE,
sbhd, bf16) gets the weights of a megacp checkpoint, runs the whole sequence on one GPU
(reference), then ``megacp.swap_attention`` replaces every TE ``DotProductAttention`` and each rank
runs only its load-balanced shard (TE's RoPE fed the shard's global positions). The CP=2 output
must match the reference within bf16 noise. Prints PASS/FAIL; exits 1 on failure.
"""

from __future__ import annotations

import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import transformer_engine.pytorch as te

import megacp
from megacp.checkpoint import load_megacp_checkpoint, save_megacp_checkpoint
from megacp.models import ModelConfig, build_model
from megacp.placement import ShardPlan

CFG = ModelConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_layers=4, num_heads=16,
                  num_kv_heads=4, rope_theta=10000.0, max_position_embeddings=1 << 16)


class TEUserModel(torch.nn.Module):
    """What a TE user writes: embedding, te.TransformerLayer stack, norm, head (megacp names)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, num_gqa_groups=cfg.num_kv_heads,
                                layernorm_epsilon=cfg.rms_norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
                                normalization="RMSNorm", activation="swiglu", bias=False, layer_number=i + 1,
                                self_attn_mask_type="causal", attn_input_format="sbhd", params_dtype=torch.bfloat16)
            for i in range(cfg.num_layers))
        self.final_norm = te.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, params_dtype=torch.bfloat16)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        rope_cls = getattr(te, "RotaryPositionEmbedding", None) or te.attention.RotaryPositionEmbedding
        self.rope = rope_cls(cfg.head_dim, rotary_base=cfg.rope_theta)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = self.rope(int(positions.max()) + 1)[positions]  # [s,1,1,d] at each token's global position
        x = self.embedding(ids).unsqueeze(1)  # [s, b=1, h]
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs)
        return self.lm_head(self.final_norm(x))[:, 0].float()


def main() -> int:
    state = megacp.initialize()
    rank, dev = state.rank, state.device
    ckpt = [tempfile.mkdtemp(prefix="megacp_te_")] if rank == 0 else [None]
    if rank == 0:
        torch.manual_seed(0)
        src = build_model(CFG, dtype=torch.bfloat16, device="cpu", backend="torch")
        save_megacp_checkpoint(ckpt[0] + "/ckpt", CFG, src.state_dict().items(), dtype=torch.bfloat16)
    dist.broadcast_object_list(ckpt)
    _, tensors = load_megacp_checkpoint(ckpt[0] + "/ckpt")
    dist.barrier()  # every rank has read the checkpoint
    if rank == 0:
        shutil.rmtree(ckpt[0])
    model = TEUserModel(CFG).to(device=dev, dtype=torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    bad = [k for k in missing if not k.endswith("_extra_state") and "rope" not in k]
    ok = not bad and not unexpected
    print(f"{'PASS' if ok else 'FAIL'} rank {rank}: megacp checkpoint loads into the TE model (missing {bad}, unexpected {unexpected})")

    seqlen = 8192 + 100
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CFG.vocab_size, (seqlen,), generator=g).to(dev)
    with torch.no_grad():
        ref = model(ids, torch.arange(seqlen, device=dev))
        swapped = megacp.swap_attention(model, state)
        plan = ShardPlan([0], [seqlen], state.size("cp"), state.rank_in("cp"))
        idx = plan.local_index().to(dev)
        out = model(ids[idx], idx)
    err = (out - ref[idx]).abs().max().item()
    scale = ref.abs().max().item()
    ok_out = err <= 2e-2 * scale
    print(f"{'PASS' if ok_out else 'FAIL'} rank {rank}: swapped {len(swapped)} TE DotProductAttention; CP=2 vs single-GPU TE logits "
          f"max|err| {err:.3e} (scale {scale:.3e}), state-dict keys kept: {sorted(model.state_dict()) == sorted(TEUserModel(CFG).state_dict())}")
    dist.destroy_process_group()
    return 0 if ok and ok_out else 1


if __name__ == "__main__":
    sys.exit(main())
