"""The memory plan of a transformers model (:mod:`megacp.integrations.hf_memory`): the sizes it reads
from the model's config, the activations its MLP norm adds, the fused RMSNorm that equals a norm of
Llama's formula bitwise and leaves any other norm alone, and megacp's layer checkpoints replacing
transformers' own without its deprecation warnings."""

from __future__ import annotations

import torch
from torch import nn

from megacp.checkpoint.hf import config_from_hf
from megacp.config import MemoryOptions
from megacp.integrations.hf_memory import LayerCheckpoints, checkpoint_layers, fuse_norms, plan_config
from megacp.train.memory import ZeroSettings, plan_memory, working_bytes_per_token
from tests.helpers.hf_archs import make_model

GIB = 2**30
LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)


def test_the_plan_reads_a_transformers_config():
    assert plan_config(LLAMA_8B) == config_from_hf(LLAMA_8B)  # an architecture megacp's models implement
    phi3 = make_model("phi3").config  # one they do not: its sizes, Llama-shaped
    cfg = plan_config(phi3)
    assert cfg is not None and (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                                cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (32, 48, 2, 4, 2, 8, 64)
    moe = {**LLAMA_8B, "architectures": ["OlmoeForCausalLM"], "num_experts": 8}
    assert plan_config(moe) is None  # experts megacp's models do not implement: no plan
    assert plan_config({"architectures": ["XForCausalLM"], "hidden_size": 8}) is None


def test_the_norm_outside_the_tiles_adds_two_layer_inputs_per_layer():
    """A transformers layer's post-attention norm runs before the tiled MLP, keeping its normalised and
    weighted [T, H] (2 x 2 bytes x H per token in bf16); untiled, both layers keep as much."""
    cfg = plan_config(LLAMA_8B)
    assert cfg is not None
    apart = working_bytes_per_token(cfg, 2, 1 << 18, mlp_tiled=True, norm_apart=True)
    assert apart - working_bytes_per_token(cfg, 2, 1 << 18, mlp_tiled=True) == 2 * 2 * 4096
    assert working_bytes_per_token(cfg, 2, 1 << 18, mlp_tiled=False, norm_apart=True) == \
        working_bytes_per_token(cfg, 2, 1 << 18, mlp_tiled=False)
    # the 32-layer 8B shape at 256K on one H100 (as tests/unit/test_train_memory.py): still planned, with
    # as many or more block inputs on the host than megacp's own layers
    zero = ZeroSettings(stage=3, partition=1, offload_optimizer=True, offload_param=False, param_bytes=2,
                        bf16_optimizer_states=True)
    auto = MemoryOptions(True, "auto", "auto", "auto")
    plans = [plan_memory(cfg, params=8_030_261_248, tokens=256 << 10, options=auto, zero=zero,
                         capacity=int(73.2 * GIB), host=120 * GIB, norm_apart=apart_) for apart_ in (False, True)]
    assert plans[1].mlp_tile == plans[0].mlp_tile == 8192
    assert (plans[1].layers_per_checkpoint, len(plans[1].offloaded_layers)) >= \
        (plans[0].layers_per_checkpoint, len(plans[0].offloaded_layers))


class _GemmaLikeNorm(nn.Module):
    """An RMSNorm scaled by ``1 + weight`` (Gemma's): not Llama's formula."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def test_fused_norms_equal_llamas_bitwise_and_leave_other_norms_alone():
    model = make_model("llama").to(torch.bfloat16)
    x = torch.randn(2, 9, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = model.model.layers[0].input_layernorm
    own = norm(x)
    (gx,) = torch.autograd.grad(own.float().square().sum(), x)
    assert fuse_norms(model) == 2 * 2 + 1
    fused = norm(x)
    (fx,) = torch.autograd.grad(fused.float().square().sum(), x)
    assert torch.equal(own, fused) and torch.allclose(gx, fx, rtol=2e-2, atol=1e-2)
    other = nn.Sequential(_GemmaLikeNorm(32))
    assert fuse_norms(other) == 0 and "forward" not in vars(other[0])



def test_layer_checkpoints_replace_transformers_own_without_a_warning():
    """``checkpoint_layers`` switches transformers' gradient checkpointing off where it is on and
    reads whether it is without transformers' deprecated ``is_gradient_checkpointing``."""
    import warnings

    plain, checkpointed = make_model("llama"), make_model("llama")
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        checkpoint_layers(plain, LayerCheckpoints())
    checkpoint_layers(checkpointed, LayerCheckpoints())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.modules())
