"""LFM2 (Lfm2ForCausalLM): our torch model against transformers on a small
random config: logits of a whole prompt, of chunks resumed from the conv
state, and greedy tokens through the engine. The engine's state-group
tests run it too (test_state_engine.py)."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.models.loader import load_model
from pdserve.kernels.models.model_config import read_config
from pdserve.kernels.models.state_cache import SeqState, StateBatch
from support.planner import save_with_noisy_norms
from support.checkpoints import lfm2_checkpoint

transformers = pytest.importorskip("transformers")

PS = 4
TOL = 1e-4
PROMPT = [(7 * i + 3) % 120 + 1 for i in range(37)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return lfm2_checkpoint(tmp_path_factory.mktemp("lfm2"))


def meta_for(begin: int, end: int, table: list) -> BatchMeta:
    slots = torch.tensor([table[p // PS] * PS + p % PS for p in range(begin, end)])
    return BatchMeta([SeqMeta(0, end - begin, end, table, 0)], slots, torch.arange(begin, end))


def test_the_config_makes_a_full_group_and_a_conv_state(checkpoint):
    hf, d = checkpoint
    cfg = read_config(d)
    assert cfg.arch == "lfm2" and cfg.state_layers() == (0, 1, 3)
    assert [g.layers for g in cfg.cache_groups()] == [(2,)]
    # the MLP width Lfm2MLP computes (2/3 of 96, rounded up to 16)
    assert cfg.intermediate_size == hf.model.layers[0].feed_forward.w1.weight.shape[0] == 64
    assert cfg.conv_state_shape() == (64, 2) and cfg.state_slot_bytes(4) == 3 * 64 * 2 * 4


def test_a_prompt_in_chunks_resumes_from_its_conv_state_and_matches_transformers(checkpoint):
    """Chunks of 16, 16 and 5 rows, each from the last one's slot, and a
    checkpoint after 8 rows of the first: transformers' logits, and the
    checkpoint equals the state a run over those 8 rows leaves."""
    hf, d = checkpoint
    model, _ = load_model(str(d), preset=None, dtype="float32", attention="torch")
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    cache = model.new_caches([16], PS)
    states = model.new_state_cache(4)
    table = list(range(10))
    got, read = [], -1
    for i, (b, e) in enumerate(((0, 16), (16, 32), (32, 37))):
        ckpt = (8, 3) if i == 0 else None
        seq = SeqState(read, i % 2, ckpt)
        got.append(model.forward(torch.tensor(PROMPT[b:e]), [meta_for(b, e, table)], cache,
                                 torch.arange(e - b), StateBatch(states, [seq])))
        read = i % 2
    assert (torch.cat(got) - want).abs().max() < TOL
    alone = model.new_state_cache(1)
    model.forward(torch.tensor(PROMPT[:8]), [meta_for(0, 8, table)], model.new_caches([16], PS),
                  torch.arange(8), StateBatch(alone, [SeqState(-1, 0)]))
    assert (alone.conv[0] - states.conv[3]).abs().max() < 1e-5


def test_greedy_tokens_through_the_engine_match_transformers(checkpoint):
    hf, d = checkpoint
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", page_size=PS,
              total_pages=64, max_scheduled_tokens=16)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([PROMPT], sp, use_tqdm=False)
    assert out.token_ids == ids[len(PROMPT):]
    llm.engine.planner.assert_idle()


def test_p_d_transfers_move_the_conv_state_alone(checkpoint):
    """LFM2 keeps no recurrent state: a slot travels as its conv row only
    (an empty tensor cannot be registered with NIXL)."""
    from pdserve.engine.executor.torch_executor import TorchExecutor
    from pdserve.scheduler.config import EngineConfig

    _, d = checkpoint
    model, tok = load_model(str(d), preset=None, dtype="float32", attention="torch")
    ex = TorchExecutor(model, tok, EngineConfig(page_size=PS, total_pages=16, state_slots=8))
    pools = ex.transfer_pools()
    assert [p.shape[0] for p in pools] == [16, 8] and pools[1] is ex.caches[1].conv
    assert ex.transfer_lists([[3, 4], [5]]) == [[3, 4], [5]]
    assert ex.group_bytes()[1] == model.cfg.state_slot_bytes(4)
