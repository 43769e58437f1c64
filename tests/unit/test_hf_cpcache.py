"""``CPCache``, the transformers ``Cache`` over megacp's CP-sharded KV cache (CP = 1, one process):
a prefill chunk and a decode step through a transformers Qwen3 give the logits of transformers'
SDPA attention over the whole sequence, and a model handed the cache without its step is refused."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.hf_archs import make_model


def test_cpcache_prefill_and_decode_equal_sdpa() -> None:
    from megacp.integrations.hf_generate import CPCache
    from megacp.kv_cache import ShardedKVCache
    from megacp.layers.settings import CPSettings
    from megacp.layers.step import begin_step

    model = make_model("qwen3", attn_implementation="sdpa").eval()
    ids = torch.tensor([[5, 17, 33, 9, 41, 12, 60]])
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits[0]
        model.set_attn_implementation("megacp")
        cache = ShardedKVCache(num_layers=2, num_kv_heads=2, head_dim=8, max_requests=1, capacity=16)
        slot = cache.allocate()
        got = []
        for start, stop in ((0, 6), (6, 7)):  # a prefill chunk of 6 tokens, then one decode step
            step = begin_step(CPSettings(prefill="pass_kv"), cache, [slot], [stop - start])
            out = model(input_ids=ids[:, start:stop], position_ids=torch.arange(start, stop)[None], cache=CPCache(step),
                        use_cache=True, megacp_step=step).logits[0]
            step.commit()
            got.append(out)
        assert float((torch.cat(got) - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
        step = begin_step(CPSettings(prefill="pass_kv"), cache, [slot], [1])
        with pytest.raises(ValueError, match="needs its step too"):
            model(input_ids=ids[:, :1], position_ids=torch.tensor([[7]]), cache=CPCache(step), use_cache=True)
