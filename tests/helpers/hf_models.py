"""Tiny random-weight Hugging Face models (fp32) for tests, saved with ``save_pretrained``.

Every kind is small (hidden 64, 2-3 layers, 4 query / 2 KV heads, vocab 256) and covers one
feature megacp must reproduce: Llama 3.1 ``llama3`` RoPE scaling, Qwen2 Q/K/V bias, Mistral with an
explicit ``head_dim`` (NH*D != H) and no sliding window, tied embeddings, and the mixture-of-experts
Mixtral (4 experts, top-2) and Qwen2-MoE (4 experts, top-2 without renormalisation, a shared
expert, a dense middle layer). Weights are drawn
large enough (std 0.1, norms around 1, non-zero biases) that attention is far from uniform, so a
wrong RoPE position or a misplaced tensor changes the logits visibly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# kind -> (transformers model class, config class, config arguments beyond _COMMON). Classes are
# named, not imported: transformers is imported only when a model is made, so that importing this
# module (e.g. in a test's worker processes) stays cheap.
KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama3": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            num_hidden_layers=3,
            # transformers 5 style; original_max_position_embeddings is small so that all three
            # llama3 bands (kept, interpolated, divided by factor) occur with head_dim 16.
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(num_hidden_layers=2, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
             use_sliding_window=False),
    ),
    "mistral": (
        "MistralForCausalLM",
        "MistralConfig",
        dict(num_hidden_layers=2, head_dim=24, sliding_window=None,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
    "mistral_window": (  # a window shorter than the prompts: decode runs past it
        "MistralForCausalLM",
        "MistralConfig",
        dict(num_hidden_layers=2, head_dim=24, sliding_window=5,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
    "qwen2_window": (  # layer 0 full causal, layer 1 under a window of 7
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=7, max_window_layers=1,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
    "llama_tied": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(num_hidden_layers=2, tie_word_embeddings=True,
             rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)),
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
             shared_expert_intermediate_size=80, mlp_only_layers=[1], norm_topk_prob=False,
             use_sliding_window=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
}


@torch.no_grad()
def make_hf_model(kind: str, directory: str | Path, *, seed: int = 0) -> torch.nn.Module:
    """Build the tiny fp32 model ``kind`` (a key of :data:`KINDS`) with random weights, save it to
    ``directory`` (safetensors) and return it (a transformers ``PreTrainedModel``) in eval mode."""
    import transformers

    model_name, config_name, extra = KINDS[kind]
    config = getattr(transformers, config_name)(**_COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * torch.randn_like(param))
        else:
            param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(str(directory))
    return model


def hf_greedy(model, prompts: list[list[int]], new_tokens: int, **options) -> list[list[int]]:
    """transformers' own generate, one prompt at a time, stop tokens off (``options``: more
    ``GenerationConfig`` fields)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                           **options)
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            res = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        outs.append(res[0, len(p):].tolist())
    return outs


CHARS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?:0123456789"
CHARS += "".join(chr(0x100 + i) for i in range(253 - len(CHARS)))  # one character for every id up to 255


def save_char_tokenizer(directory: Path) -> None:
    """A character-level tokenizer (ids 3..255 for :data:`CHARS`; 0 pad, 1 bos, 2 eos) with a chat
    template, saved where the model is."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}.{% endfor %}"
                          "{% if add_generation_prompt %}A:{% endif %}")
    fast.save_pretrained(str(directory))
