"""The segmented batched LoRA: rows grouped by adapter, short groups padded
into one batched matmul, long ones run alone. Each row equals its adapter
run alone, whatever the mix of adapters and group lengths."""

import pytest
import torch

from support.lora import tiny_adapter, tiny_llama
from pdserve.kernels.models.loader import load_model
from pdserve.kernels.lora.batched import LoraRound, LoraSegments
from pdserve.kernels.lora.adapter import load_adapter
from pdserve.kernels.lora.masked import MaskedLoraRound
from test_lora_kernels import batch
from support.lora import PROMPTS

ADAPTERS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora16")
    tiny_llama(d / "base")
    m, _ = load_model(str(d / "base"), None, dtype="float32", device="cpu", attention="torch")
    m.enable_lora(slots=ADAPTERS, max_rank=8)
    for i in range(ADAPTERS):       # ranks 1..8 and two target sets, so padding is exercised
        targets = ("q_proj", "v_proj", "o_proj", "down_proj") if i % 3 == 0 else \
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        a = tiny_adapter(d / f"a{i}", seed=10 + i, rank=1 + i % 8, targets=targets)
        m.lora.load(i, load_adapter(a, m.cfg, max_rank=8))
    return m


def run(model, prompts, slots, kernel=LoraRound.of):
    """Last-token logits of each prompt, prompt i under slot `slots[i]`."""
    ids, meta, cache, last = batch(model, prompts)
    rows = [s for p, s in zip(prompts, slots) for _ in p]
    return model.forward(ids, meta, cache, last, lora=kernel(model.lora, rows))


def test_sixteen_adapters_in_one_batch_each_equal_their_adapter_alone(model):
    """Rows of 16 different adapters (and the base) in one forward: each
    row's logits are those of its prompt run alone under its adapter."""
    prompts = [PROMPTS[i % 3][: 3 + i % 5] for i in range(ADAPTERS + 1)]
    slots = list(range(ADAPTERS)) + [-1]
    mixed = run(model, prompts, slots)
    for i, (p, s) in enumerate(zip(prompts, slots)):
        alone = run(model, [p], [s])[0]
        assert torch.allclose(mixed[i], alone, atol=1e-5, rtol=0), (i, mixed[i] - alone)
    distinct = {tuple(mixed[i].round(decimals=3).tolist()) for i in range(len(prompts))}
    assert len(distinct) == len(prompts)        # every adapter changes its row


def test_a_long_group_runs_alone_and_short_ones_are_batched():
    """A 40-row prefill under slot 2 beside one decode row under each of 0,
    1 and 3: the short groups are one padded batch, the long one runs alone,
    base rows are in neither."""
    rows = [0, -1, 1] + [2] * 40 + [3, -1]
    seg = LoraSegments.of(rows)
    assert seg.slots == (0, 1, 3) and seg.width == 1
    assert seg.alone == ((2, tuple(range(3, 43))),)
    assert seg.src == (0, 2, 43) and seg.dst == (0, 1, 2)
    assert seg.active == [0, 1, 2, 3]
    one = LoraSegments.of([5, 5, -1, 5])                 # a single group runs alone
    assert one.slots == () and one.alone == ((5, (0, 1, 3)),)
    uneven = LoraSegments.of([0, 0, 0, 1, 2, 2])         # 3, 1, 2 rows: padded to 3 each
    assert uneven.slots == (0, 1, 2) and uneven.width == 3 and uneven.padded
    assert uneven.dst == (0, 1, 2, 3, 6, 7)
    assert LoraSegments.of([-1, -1]).active == []


@pytest.mark.parametrize("slots", [
    [3, -1, 3, 7, 7, 7, 0],                 # uneven groups: padded
    [4] * 7,                                # one adapter: alone, as slices
    [2] + [1] * 10 + [3, 1],                # a long group with a gap: alone, by index
    list(range(7)),                         # one row each, rows in order: no copy
])
def test_the_segmented_kernel_equals_the_masked_one(model, slots):
    """Every path of the segmented round (padded batch, alone by slice or by
    index, rows already in order) equals the masked kernel it replaced."""
    prompts = [PROMPTS[i % 3] for i in range(len(slots))]
    seg = LoraSegments.of(slots)
    assert seg.slots or seg.alone
    got = run(model, prompts, slots)
    want = run(model, prompts, slots, MaskedLoraRound)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_a_prefill_chunk_beside_decode_rows_equals_each_alone(model):
    """A long prompt under one adapter with short ones under others (the
    long group runs alone, the rest batched, padded)."""
    long = list(range(1, 60))
    prompts = [long, [7, 8], [9, 10, 11], [12], [13, 14]]
    slots = [5, 6, 6, 9, -1]
    mixed = run(model, prompts, slots)
    for i, (p, s) in enumerate(zip(prompts, slots)):
        alone = run(model, [p], [s])[0]
        assert torch.allclose(mixed[i], alone, atol=1e-5, rtol=0), (i, mixed[i] - alone)


def test_the_kernel_paths_are_the_ones_named():
    """The cases above reach the paths they name."""
    assert LoraSegments.of([2] + [1] * 10 + [3, 1]).alone == \
        ((1, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12)),)
    assert LoraSegments.of(list(range(7))).padded is False
