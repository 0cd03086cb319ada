"""A model preset with state layers (Qwen3-Next-80B's Gated DeltaNet): its
slot size from the config, its cache groups, and `pdserve bench
state-capacity`'s arithmetic."""

import dataclasses

import pytest

from pdserve.benchmarks.cache import state_capacity as bench
from pdserve.benchmarks.cache.bounds import kv_pool_bytes
from pdserve.sim.cost.roofline import GPUS, MODELS, CostModel, ModelPreset, gdn_layer_state_bytes
from pdserve.scheduler import ConfigError
from pdserve.scheduler.cache.groups import (FULL, FULL_HISTORY, SLIDING_WINDOW, CacheGroupSpec,
                                            check_groups)

QWEN = MODELS["qwen3-next-80b"]
MiB = 2**20


def test_one_qwen3_next_state_slot_is_73_7_mib():
    """Per GDN layer: a 32 x 128 x 128 fp32 recurrent state and an 8,192 x 3
    bf16 conv state; 36 such layers (hybrid-cache.md §4.3: 73.7 MiB)."""
    assert gdn_layer_state_bytes(16, 128, 32, 128, 4) == 2 * MiB + 48 * 1024
    assert QWEN.state_layers == 36
    assert QWEN.state_bytes / MiB == pytest.approx(73.7, abs=0.1)
    # bf16 recurrent state instead: the notes' 37.7 MiB
    assert 36 * gdn_layer_state_bytes(16, 128, 32, 128, 4, state_dtype_bytes=2) / MiB == \
        pytest.approx(37.7, abs=0.1)


def test_qwen3_next_has_12_attention_layers_then_a_state_group_of_36_last():
    full, state = QWEN.groups()
    assert full.keeps_history and full.layers == tuple(range(3, 48, 4))
    assert state.state and len(state.layers) == 36
    assert sorted(full.layers + state.layers) == list(range(48))
    check_groups([full, state], page_size=16)          # state last, beside full history
    # K/V only in the attention layers: 12 x K and V x 2 heads x 256 x bf16
    assert QWEN.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24 * 1024
    assert QWEN.group_kv_bytes_per_token([full, state]) == [24 * 1024, 0]
    assert QWEN.layer_kinds() == (full.layers, ())
    assert QWEN.state_layer_indices() == state.layers


def test_a_state_slot_is_the_state_group_s_page_in_copies_and_transfers():
    full, state = QWEN.groups()
    assert QWEN.group_page_bytes([full, state], 16) == [16 * 24 * 1024, QWEN.state_bytes]
    assert QWEN.groups(sliding=False) == [full, state]


def test_existing_presets_groups_are_unchanged():
    for name in ("llama-3-8b", "llama-3-70b", "opt-13b", "tiny"):
        m = MODELS[name]
        assert m.groups() == [FULL]
        assert m.layer_kinds() == (tuple(range(m.layers)), ())
        assert m.state_layer_indices() == ()
    for name, step, window in (("gemma-3-27b", 6, 1024), ("gpt-oss-120b", 2, 128)):
        m = MODELS[name]
        full = tuple(range(step - 1, m.layers, step))
        rest = tuple(i for i in range(m.layers) if i not in full)
        expected = [CacheGroupSpec(FULL_HISTORY, layers=full),
                    CacheGroupSpec(SLIDING_WINDOW, window, layers=rest)]
        assert m.groups() == expected
        assert m.groups(sliding=False) == [FULL]
        assert m.group_kv_bytes_per_token([FULL]) == [m.layers * m.kv_layer_bytes]


@pytest.mark.parametrize("change, says", [
    (dict(state_bytes=0), "state layers need state_bytes"),
    (dict(state_layers=0), "state_bytes needs state layers"),
    (dict(state_layers=48), "needs a full-attention group"),
    (dict(sliding_layers=4, window=128), "set sliding_layers or state_layers to 0"),
])
def test_a_state_preset_is_checked(change, says):
    with pytest.raises(ConfigError, match=says):
        dataclasses.replace(QWEN, **change)


def test_a_long_decode_reads_only_the_attention_layers_k_v():
    h100 = GPUS["h100"]
    hybrid, pure = CostModel(QWEN, h100), CostModel(bench.every_layer_attention(QWEN), h100)
    ctx = 64 * 32768
    saved = (48 - 12) * QWEN.kv_layer_bytes * ctx / (h100.mem_bw * h100.mbu)
    assert pure.round_seconds([], ctx, 64) - hybrid.round_seconds([], ctx, 64) == \
        pytest.approx(saved, rel=1e-9)


# ---- bench state-capacity's arithmetic ---------------------------------------

# 4 layers, one attention (K/V 2 x 1 head x 8 x 2 B = 32 B a token), three
# state layers of 1,000 bytes together
TOY = ModelPreset("toy", 1e9, 4, 4, 1, 8, 4096, state_layers=3, state_bytes=1000)


def test_capacity_on_a_hand_computed_case():
    # a 31-token prompt + its decode slot: 2 pages of 16 tokens x 32 B = 1,024 B
    # of K/V, and 2 slots of 1,000 B: 3,024 B a request. The chunk in flight
    # holds 2 slots more, so 3 requests need 2,000 + 3 x 3,024 = 11,072 B
    c = bench.capacity(TOY, 11_072, 31)
    assert (c.kv_bytes, c.slots, c.state_bytes, c.request_bytes) == (1024, 2, 2000, 3024)
    assert c.requests == 3
    assert bench.capacity(TOY, 11_071, 31).requests == 2
    # every layer attention: 4 x 32 B x 32 tokens = 4,096 B, no slots: 2 fit
    p = bench.capacity(bench.every_layer_attention(TOY), 10_000, 31)
    assert (p.kv_bytes, p.slots, p.requests) == (4096, 0, 2)
    # vLLM-style: a layer's 334 B of state fits one 16-token page (512 B); the
    # attention layer is a group of 1, so 3 state pages a slot, each padded
    v = bench.vllm_capacity(TOY, 10_000, 31)
    assert (v.block, v.kv_bytes, v.slot_bytes, v.request_bytes, v.requests) == \
        (16, 1024, 1536, 4096, 2)


def test_qwen3_next_at_32k_holds_over_three_times_the_requests_of_pure_attention():
    pool = 416e9           # 8 x 80 GB x 90% - 160 GB of weights
    c = bench.capacity(QWEN, pool, 32768)
    assert c.kv_bytes == 2049 * 16 * 24 * 1024                  # 32,768 + the decode slot
    assert c.request_bytes == 2049 * 16 * 24 * 1024 + 2 * QWEN.state_bytes
    p = bench.capacity(bench.every_layer_attention(QWEN), pool, 32768)
    assert p.request_bytes == 2049 * 16 * 96 * 1024
    assert (c.requests, p.requests) == (433, 129)
    assert kv_pool_bytes(QWEN, GPUS["h100"], gpus=8) == pytest.approx(pool)


def test_vllm_raises_qwen3_next_s_block_to_hold_one_layer_s_state():
    """One layer's state is 1,048 tokens of one layer's K/V (§4.3), rounded
    up to FlashAttention's multiple of 16."""
    assert bench.vllm_block(QWEN, kernel_block=1) == 1048
    assert bench.vllm_block(QWEN) == 1056
    v = bench.vllm_capacity(QWEN, 416e9, 32768)
    assert v.kv_bytes == 32 * 12 * 1056 * 2048                  # 32 blocks of 1,056
    assert v.slot_bytes == 36 * 1056 * 2048 > QWEN.state_bytes  # padded
    assert v.requests < bench.capacity(QWEN, 416e9, 32768).requests
