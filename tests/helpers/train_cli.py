"""What ``python -m megacp.train`` tests train: a tiny random Llama (or Qwen2-MoE) Hugging Face
directory with a byte-level tokenizer, and a tiny corpus directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def make_tiny_model(directory: Path, *, moe: bool = False, arch: str = "llama") -> None:
    """A random fp32 Llama (2 layers, hidden 64, 4 / 2 heads; with ``moe`` a Qwen2-MoE of 4 experts,
    top-2, and a shared expert; ``arch="qwen3"`` or ``"falcon"`` those transformers architectures of
    the same size) with a byte-level tokenizer (256 byte tokens + ``<s>`` and ``</s>``), saved with
    ``save_pretrained``."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": len(vocab), "</s>": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    common = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"])
    torch.manual_seed(0)
    if moe:
        config = transformers.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                             shared_expert_intermediate_size=80, use_sliding_window=False)
        transformers.Qwen2MoeForCausalLM(config).float().save_pretrained(directory)
    elif arch == "qwen3":
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16)).float().save_pretrained(directory)
    elif arch == "falcon":
        config = transformers.FalconConfig(**{k: v for k, v in common.items() if k != "intermediate_size"})
        transformers.FalconForCausalLM(config).float().save_pretrained(directory)
    else:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).float().save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def make_corpus(directory: Path) -> Path:
    """A corpus directory with a text file and a JSONL file (one document of 6 lines, three short ones)."""
    directory.mkdir()
    (directory / "a.txt").write_text("Context parallelism splits one long sequence over several ranks.\n" * 6)
    (directory / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ("ring attention", "x", "pass-KV " * 9)))
    return directory
