"""The training memory options and plan: config parsing with one-line refusals, the ZeRO placement
of model states, the plan's choices against hand-computed sizes (Llama-3.1-8B shape), and the host
bytes an offloaded input holds."""

from __future__ import annotations

import mmap

import pytest
import torch

from megacp.config import ConfigError, MemoryOptions, read_memory_options
from megacp.models.checkpointing import CUDA_HOST_REGISTER_PORTABLE, page_locked_empty, page_unlock
from megacp.models.config import ModelConfig
from megacp.train.memory import (
    HOST_RESERVE_BYTES,
    MemoryPlanError,
    ZeroSettings,
    longest_fitting,
    pinned_bytes,
    plan_memory,
    state_bytes,
)

GIB = 2**30
LLAMA = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=4,
                    num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=1 << 22,
                    tie_word_embeddings=False)
PARAMS = 1_920_000_000


def test_options_from_the_deepspeed_config():
    assert read_memory_options({}) == MemoryOptions(False, "none", "auto")
    assert read_memory_options({}, activation_checkpointing=True).activation_checkpointing
    got = read_memory_options({"activation_checkpointing": {"enabled": True, "offload": "cpu"},
                               "sequence_tiling": {"mlp": 4096}})
    assert got == MemoryOptions(True, "cpu", 4096)
    assert read_memory_options({"activation_checkpointing": {"cpu_checkpointing": False}}).offload == "none"


@pytest.mark.parametrize("raw, message", [
    ({"activation_checkpointing": {"offload": "cpu"}},
     'activation_checkpointing.offload: "cpu" needs checkpointing on ("enabled": true or --activation-checkpointing)'),
    ({"activation_checkpointing": {"enabled": True, "offload": "gpu"}},
     "activation_checkpointing.offload: got 'gpu'; allowed values: 'none', 'cpu', 'auto'"),
    ({"activation_checkpointing": {"cpu_checkpointing": True}},
     "activation_checkpointing.cpu_checkpointing: configures deepspeed.checkpointing, which megacp's layers do not "
     'use (they checkpoint themselves); use "offload": "cpu"'),
    ({"activation_checkpointing": {"partition_activations": True}},
     "activation_checkpointing.partition_activations: configures deepspeed.checkpointing, which megacp's layers do "
     "not use (they checkpoint themselves); remove it"),
    ({"activation_checkpointing": {"enable": True}},
     "activation_checkpointing.enable: unknown key; allowed keys: enabled, offload, layers_per_checkpoint"),
    ({"activation_checkpointing": {"enabled": True, "layers_per_checkpoint": 0}},
     "activation_checkpointing.layers_per_checkpoint: got 0; allowed values: an integer >= 1 or 'auto'"),
    ({"activation_checkpointing": {"layers_per_checkpoint": 2}},
     "activation_checkpointing.layers_per_checkpoint: needs activation checkpointing (\"enabled\": true or "
     "--activation-checkpointing)"),
    ({"sequence_tiling": {"mlp": -1}}, "sequence_tiling.mlp: got -1; allowed values: 'auto' or an integer >= 0"),
])
def test_bad_options_are_one_line(raw, message):
    with pytest.raises(ConfigError) as err:
        read_memory_options(raw)
    assert str(err.value) == message


def test_state_bytes_follow_the_zero_stage():
    bf16 = dict(partition=1, dtype=torch.bfloat16)
    n, big = 1000, 10
    # ZeRO 1 on one rank: bf16 weights + grads, fp32 master + grad partition + two Adam moments
    assert state_bytes(n, big, ZeroSettings.from_config({"zero_optimization": {"stage": 1}}, **bf16)) == (20 * n, 0)
    # the optimizer's part on the host; reduced gradients stream there under stage 2
    z2 = ZeroSettings.from_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, **bf16)
    assert state_bytes(n, big, z2) == (2 * n, 16 * n)
    # stage 3 over 4 ranks with parameters offloaded: two gathered modules stay on the GPU
    z3 = ZeroSettings.from_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                   "offload_optimizer": {"device": "cpu"}}}, partition=4, dtype=torch.bfloat16)
    assert state_bytes(n, big, z3) == (2 * big * 2, 5 * n)  # optimizer 4, weights 1/2, gradient partition 1/2
    z3b = ZeroSettings.from_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                                    "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                             "bf16_optimizer_states": True}}, partition=1, dtype=torch.bfloat16)
    assert state_bytes(n, big, z3b)[1] == 10 * n  # bf16 master, gradient, moments + the gradient partition


def test_plan_picks_the_cheapest_settings_that_fit():
    zero1 = ZeroSettings.from_config({"zero_optimization": {"stage": 1}}, partition=1, dtype=torch.bfloat16)
    auto = MemoryOptions(True, "auto", "auto")
    cap = 134 * GIB
    short = plan_memory(LLAMA, params=PARAMS, tokens=64 << 10, options=auto, zero=zero1, capacity=cap)
    assert (short.mlp_tile, short.offloaded_layers) == (0, frozenset())  # fits as it is: nothing traded
    long = plan_memory(LLAMA, params=PARAMS, tokens=512 << 10, options=auto, zero=zero1, capacity=cap)
    assert long.mlp_tile == 8192 and long.gpu_bytes <= cap
    with pytest.raises(MemoryPlanError, match="will not fit: 1048576 tokens per rank.*try ZeRO 3 with offload"):
        plan_memory(LLAMA, params=PARAMS, tokens=1 << 20, options=auto, zero=zero1, capacity=cap)
    zero2 = ZeroSettings.from_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                                     partition=1, dtype=torch.bfloat16)
    million = plan_memory(LLAMA, params=PARAMS, tokens=1 << 20, options=MemoryOptions(True, "cpu", 8192), zero=zero2,
                          capacity=cap, host=120 * GIB)
    assert million.offloaded_layers == frozenset(range(4))
    assert million.host_bytes == 16 * PARAMS + 4 * 2 * 4096 * (1 << 20)  # optimizer + four offloaded layer inputs
    with pytest.raises(MemoryPlanError, match="host memory"):
        plan_memory(LLAMA, params=PARAMS, tokens=1 << 20, options=MemoryOptions(True, "cpu", 8192), zero=zero2,
                    capacity=cap, host=40 * GIB)
    longest = longest_fitting(LLAMA, params=PARAMS, options=auto, zero=zero1, capacity=cap, host=None, multiple=2)
    assert 512 << 10 <= longest < 1 << 20
    plan_memory(LLAMA, params=PARAMS, tokens=longest, options=auto, zero=zero1, capacity=cap)
    with pytest.raises(MemoryPlanError):
        plan_memory(LLAMA, params=PARAMS, tokens=longest + 2, options=auto, zero=zero1, capacity=cap)


def test_the_second_checkpoint_level_keeps_fewer_inputs_on_the_host():
    """32 layers of the 8B shape at 256K tokens, every input on the host: 32 inputs (8 KiB/token each,
    64 GiB) do not fit a host with 40 GiB free beyond the states; "auto" takes blocks of 2 (16 inputs,
    32 GiB) and holds the 2 inputs of the block being recomputed on the GPU, "layers_per_checkpoint": 4
    blocks of 4 (8 inputs)."""
    cfg = ModelConfig(**{**LLAMA.to_dict(), "num_layers": 32})
    zero = ZeroSettings(stage=3, partition=1, offload_optimizer=True, offload_param=True, param_bytes=2)
    tokens, layer_input = 256 << 10, 2 * 4096 * (256 << 10)
    states = state_bytes(8_000_000_000, cfg.vocab_size * cfg.hidden_size, zero)[1]
    host = states + 40 * GIB + HOST_RESERVE_BYTES
    per_layer = MemoryOptions(True, "cpu", 8192)
    with pytest.raises(MemoryPlanError, match='try "activation_checkpointing": {"layers_per_checkpoint": "auto"}'):
        plan_memory(cfg, params=8_000_000_000, tokens=tokens, options=per_layer, zero=zero, capacity=None, host=host)
    auto = plan_memory(cfg, params=8_000_000_000, tokens=tokens, options=MemoryOptions(True, "cpu", 8192, "auto"),
                       zero=zero, capacity=None, host=host)
    assert auto.layers_per_checkpoint == 2 and auto.offloaded_layers == frozenset(range(0, 32, 2))
    assert auto.host_bytes == states + 16 * layer_input
    assert "checkpoints of 2 layers, 16 block inputs offloaded" in auto.describe()
    four = plan_memory(cfg, params=8_000_000_000, tokens=tokens, options=MemoryOptions(True, "cpu", 8192, 4),
                       zero=zero, capacity=None, host=host)
    assert four.layers_per_checkpoint == 4 and four.host_bytes == states + 8 * layer_input
    assert four.gpu_bytes - auto.gpu_bytes == 2 * layer_input  # 4 inputs of the recomputed block instead of 2


def test_the_32_layer_8b_shape_on_one_h100():
    """The full Llama-3.1-8B shape (32 layers, 8.03B parameters) as ``scripts/bench/train_long.py
    --layers 32 --bf16-optimizer-states`` trains it: ZeRO 3, bf16 weights on the GPU, bf16 master
    weights, gradients and Adam moments on the host; an H100's 79.2 GiB less the 6 GiB reserve, 120
    GiB of host available. Host states are 10 bytes a parameter (DeepSpeed's stage 3 also keeps its
    gradient partition there); the 16K step measured 91.1 GiB peak RSS with every input offloaded."""
    cfg = ModelConfig(**{**LLAMA.to_dict(), "num_layers": 32})
    params = 8_030_261_248
    zero = ZeroSettings(stage=3, partition=1, offload_optimizer=True, offload_param=False, param_bytes=2,
                        bf16_optimizer_states=True)
    cap, host = int(73.2 * GIB), 120 * GIB
    states = state_bytes(params, cfg.vocab_size * cfg.hidden_size, zero)[1]
    assert states == 10 * params
    every = MemoryOptions(True, "cpu", "auto")
    auto = MemoryOptions(True, "auto", "auto", "auto")
    short = plan_memory(cfg, params=params, tokens=16 << 10, options=every, zero=zero, capacity=cap, host=host)
    assert abs(short.host_bytes + HOST_RESERVE_BYTES - 91.1 * GIB) < 1 * GIB  # against the measured RSS
    # every layer input on the host: 32 x 2 GiB at 256K is past the host
    with pytest.raises(MemoryPlanError, match="will not fit in host memory: 262144 tokens"):
        plan_memory(cfg, params=params, tokens=256 << 10, options=every, zero=zero, capacity=cap, host=host)
    # a 192K input (1.5 GiB) is held in a pinned buffer of exactly 1.5 GiB
    assert pinned_bytes(2 * 4096 * (192 << 10)) == 3 * GIB // 2
    mid = plan_memory(cfg, params=params, tokens=192 << 10, options=auto, zero=zero, capacity=cap, host=host)
    assert (mid.layers_per_checkpoint, len(mid.offloaded_layers), mid.mlp_tile) == (1, 11, 8192)
    assert mid.host_bytes == states + 11 * 3 * GIB // 2
    # 256K: every layer its own checkpoint needs 20 inputs (40 GiB) on the host beside 74.8 GiB of
    # states, past 120 GiB less the reserve; blocks of 2 keep 10 of 16 block inputs on the GPU
    long = plan_memory(cfg, params=params, tokens=256 << 10, options=auto, zero=zero, capacity=cap, host=host)
    assert (long.layers_per_checkpoint, long.offloaded_layers) == (2, frozenset(range(0, 12, 2)))
    assert long.gpu_bytes <= cap and long.host_bytes + HOST_RESERVE_BYTES <= host
    assert long.host_bytes == states + 6 * 2 * GIB
    with pytest.raises(MemoryPlanError):  # 384K: the attention's backward alone is ~37 GiB
        plan_memory(cfg, params=params, tokens=384 << 10, options=auto, zero=zero, capacity=cap, host=host)
    assert 256 << 10 < longest_fitting(cfg, params=params, options=auto, zero=zero, capacity=cap, host=host,
                                       multiple=2) < 384 << 10


def test_offloaded_inputs_hold_whole_pages(monkeypatch):
    """An offloaded input holds its bytes rounded up to a page, not to a power of two: the plan's
    :func:`pinned_bytes` and the buffer :func:`page_locked_empty` pins for the stash (its CUDA calls
    recorded here: the exact byte count from a page boundary, then unlocked by :func:`page_unlock`)."""
    assert [pinned_bytes(n, page=4096) for n in (0, 1, 4096, 4097, 3 * GIB // 2)] == [0, 4096, 4096, 8192, 3 * GIB // 2]
    assert pinned_bytes(100_000, page=65536) == 131072 and pinned_bytes(3 * GIB + 1) == 3 * GIB + mmap.PAGESIZE

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the CUDA runtime's name
            calls.append(("register", ptr, nbytes, flags))
            return 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    host = page_locked_empty((3, 1000), torch.bfloat16)
    assert host.shape == (3, 1000) and host.dtype == torch.bfloat16 and host.data_ptr() % mmap.PAGESIZE == 0
    host.fill_(2.0)
    assert calls == [("register", host.data_ptr(), 6000, CUDA_HOST_REGISTER_PORTABLE)]
    ptr, buffers = host.data_ptr(), [host, page_locked_empty((0, 8), torch.float32)]  # nothing to pin
    assert len(calls) == 1 and buffers[1].numel() == 0
    page_unlock(buffers, None)
    assert calls[1:] == [("unregister", ptr)] and buffers == [] and host.float().sum().item() == 6000.0
