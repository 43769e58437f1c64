"""Tiny random-weight transformers causal LMs of six architectures, built from transformers' own
configs (fp32), and a packed batch of ragged documents, for the ``attn_implementation="megacp"`` tests."""

from __future__ import annotations

from typing import Any

import torch

SMALL: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                              num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)

ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(use_sliding_window=False)),  # q/k/v bias
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=8)),  # q/k RMS norm
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None, head_dim=12)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {}),  # fused qkv
    "granite": ("GraniteForCausalLM", "GraniteConfig",  # attention_multiplier: a non-default scale
                dict(attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0)),
}
"""name -> (model class, config class, config arguments beyond :data:`SMALL`)."""

REFUSED: dict[str, tuple[str, str, dict[str, Any]]] = {
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_head=4, n_layer=2)),  # ALiBi
    "mpt": ("MptForCausalLM", "MptConfig", dict(d_model=32, n_heads=4, n_layers=2)),
}
"""Architectures whose attention does not go through transformers' attention interface with the
model's arguments (megacp refuses them): name -> (model class, config class, config arguments)."""


def make_refused(arch: str, attn_implementation: str = "megacp") -> torch.nn.Module:
    """The tiny fp32 model ``arch`` of :data:`REFUSED` (vocabulary 64), built for ``attn_implementation``."""
    import transformers

    model_name, config_name, kw = REFUSED[arch]
    config = getattr(transformers, config_name)(vocab_size=SMALL["vocab_size"], **kw)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).float().eval()


DOCS = [9, 13, 5]
"""Packed documents: ragged, one shorter than 2N at N = 3."""


def make_model(arch: str, seed: int = 0, **extra: Any) -> torch.nn.Module:
    """The tiny fp32 model ``arch`` with random weights (norms around 1, non-zero biases)."""
    import transformers

    model_name, config_name, kw = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**SMALL, **kw, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    return model


def packed_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[1, T]`` ids, per-document position ids and per-document shifted labels (-100 at ends)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SMALL["vocab_size"], (sum(DOCS),), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOCS])
    targets, start = [], 0
    for n in DOCS:
        targets += ids[start + 1 : start + n].tolist() + [-100]
        start += n
    return ids.unsqueeze(0), pos.unsqueeze(0), torch.tensor(targets).unsqueeze(0)
