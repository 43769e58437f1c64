"""swap_attention: what it replaces, what it keeps, and that a swapped model computes the same."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import torch

import megacp
from megacp.layers.attention import DotProductAttention
from megacp.layers.cp_attention import CPDotProductAttention
from megacp.layers.swap import TECPDotProductAttention
from megacp.models import ModelConfig, build_model
from tests.helpers.paths import ROOT
from tests.helpers.timeouts import HANG_GUARD_S

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, max_position_embeddings=1024)


def test_swap_keeps_names_and_weights_and_output() -> None:
    torch.manual_seed(0)
    model = build_model(CFG, dtype=torch.float32, device="cpu", backend="torch")
    keys = list(model.state_dict())
    ids = torch.randint(0, CFG.vocab_size, (50,))
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    pos = torch.cat([torch.arange(20), torch.arange(30)])
    with torch.no_grad():
        before = model(ids, pos, cu_seqlens=cu)
    swapped = megacp.swap_attention(model)  # no process group: CP = 1
    assert swapped == [f"layers.{i}.self_attention.core_attention" for i in range(CFG.num_layers)]
    assert all(isinstance(model.get_submodule(n), CPDotProductAttention) for n in swapped)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        after = model(ids, pos, cu_seqlens=cu)
    assert torch.allclose(after, before, atol=1e-6)
    with pytest.warns(UserWarning, match="nothing was swapped"):  # already swapped: nothing left
        assert megacp.swap_attention(model) == []


def test_swap_warns_when_there_is_nothing_to_swap() -> None:
    with pytest.warns(UserWarning, match="nothing was swapped"):
        assert megacp.swap_attention(torch.nn.Linear(2, 2)) == []


def test_te_replacement_keeps_extra_state_entries() -> None:
    layer = TECPDotProductAttention(4, 16, 2, extra_state=torch.zeros(0))
    assert "_extra_state" in layer.state_dict()
    layer.load_state_dict({"_extra_state": torch.ones(3)})
    assert torch.equal(layer.get_extra_state(), torch.ones(3))
    assert "_extra_state" not in CPDotProductAttention(4, 16, 2).state_dict()


_TE_REASON = None
if importlib.util.find_spec("transformer_engine") is None:
    _TE_REASON = "Transformer Engine is not installed (docs/GPU_FACTS.md: how it runs on the GPU machine)"
elif not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    _TE_REASON = "the TE swap check needs 2 CUDA GPUs"


@pytest.mark.skipif(_TE_REASON is not None, reason=_TE_REASON or "")
def test_real_te_model_swapped_matches_single_gpu() -> None:
    """A model of real te.TransformerLayers: megacp checkpoint loads, CP=2 equals single GPU."""
    root = ROOT
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(root / "tests" / "programs" / "te_swap_check.py")], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_swap_that_fails_leaves_the_model_unchanged() -> None:
    from megacp.layers.attention import DotProductAttention

    model = torch.nn.Sequential(DotProductAttention(4, 8, 2), DotProductAttention(4, 8, 2, attn_mask_type="no_mask"))
    with pytest.raises(ValueError, match="needs a causal mask"):
        megacp.swap_attention(model)
    assert [type(m) for m in model] == [DotProductAttention, DotProductAttention]


def test_swap_keeps_each_modules_training_mode() -> None:
    from megacp.layers.attention import DotProductAttention

    model = torch.nn.ModuleList([DotProductAttention(4, 8, 2, 0.1), DotProductAttention(4, 8, 2)])
    model[0].eval()  # eval: its dropout setting does not apply
    megacp.swap_attention(model)
    assert [m.training for m in model] == [False, True]
    q, k = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8)
    assert model[0](q, k, k).shape == (1, 6, 32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp_group=object()), "cp_group= is Transformer Engine's own CP"),
    (dict(cp_global_ranks=[0, 1]), "cp_global_ranks= is Transformer Engine's own CP"),
    (dict(cp_comm_type="p2p"), "cp_comm_type= is Transformer Engine's own CP"),
    (dict(ring=object()), "ring= is Transformer Engine's own CP"),
    (dict(tp_size=2), "tp_size=2 is not supported"),
    (dict(attention_type="cross"), "attention_type='cross' is not supported"),
    (dict(windw_size=(3, 0)), "unexpected keyword argument 'windw_size'"),
])
def test_te_arguments_megacp_does_not_honour_are_refused(kwargs: dict, message: str) -> None:
    """A TE constructor argument the layer would ignore is one TypeError naming it (the layer would
    otherwise run at CP 1); TE's harmless ones are accepted."""
    for cls in (DotProductAttention, CPDotProductAttention):
        with pytest.raises(TypeError, match=re.escape(message)):
            cls(4, 8, 2, **kwargs)
        cls(4, 8, 2, sequence_parallel=False, tp_size=1, tp_group=None, attention_type="self", cp_group=None)


TE_NEUTRAL_CALL = dict(cu_seqlens_kv_padded=None, window_size=(-1, 0), checkpoint_core_attention=False,
                       core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None,
                       fast_zero_fill=True, pad_between_seqs=None, fp8_output=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes=<tensor of shape (4,)>: ALiBi is not implemented (allowed: None)"),
    (dict(core_attention_bias_type="post_scale_bias", core_attention_bias=torch.zeros(1, 4, 10, 10)),
     "core_attention_bias_type='post_scale_bias': attention biases are not implemented (allowed: 'no_bias', None); "
     "core_attention_bias=<tensor of shape (1, 4, 10, 10)>: attention biases are not implemented (allowed: None)"),
    (dict(window_size=(3, 0)),
     "window_size=(3, 0) differs from the layer's own window_size=None: a layer's window is set when it is built"),
    (dict(checkpoint_core_attention=True), "checkpoint_core_attention=True: recomputing core attention in the "
     "backward is not implemented (allowed: False, None)"),
    (dict(cu_seqlens_q_padded=torch.tensor([0, 5, 12], dtype=torch.int32)),
     "cu_seqlens_q_padded=<tensor of shape (3,)>: padding between sequences is not supported "
     "(allowed: None or cu_seqlens_q)"),
    (dict(windw_size=(3, 0)), "unexpected keyword argument 'windw_size'"),
])
def test_te_call_arguments_the_layer_does_not_honour_are_refused(kwargs: dict, message: str) -> None:
    """A per-call TE argument the layer would ignore (ALiBi, a bias, another window, a typo) is one
    ValueError naming it; TE's neutral values give the output of a call without them."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(10, 4, 8, generator=g), torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for cls in (DotProductAttention, CPDotProductAttention):
        layer = cls(4, 8, 2, qkv_format="thd", layer_number=1).eval()
        with pytest.raises(ValueError) as caught:
            layer(q, k, v, cu_seqlens_q=cu, **kwargs)
        assert str(caught.value) == f"{cls.__name__}.forward: {message}"
        plain = layer(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        neutral = layer(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, **TE_NEUTRAL_CALL)
        assert torch.equal(plain, neutral)


def test_a_windowed_layer_takes_its_own_window_per_call() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(12, 4, 8, generator=g), torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    cu = torch.tensor([0, 12], dtype=torch.int32)
    layer = CPDotProductAttention(4, 8, 2, qkv_format="thd", layer_number=1, window_size=(3, 0))
    assert torch.equal(layer(q, k, v, cu_seqlens_q=cu, window_size=(3, 0)), layer(q, k, v, cu_seqlens_q=cu))
    with pytest.raises(ValueError, match=re.escape("window_size=(-1, 0) differs from the layer's own window_size=(3, 0)")):
        layer(q, k, v, cu_seqlens_q=cu, window_size=(-1, 0))
