"""A draft model's K/V in the planner's pages (engine/spec/draft.py,
kernels/kv_cache.py): each page holds the draft's layers after the
target's, so the draft's K/V are admitted, counted, cached, stored to the
host tier and shipped P -> D with the target's, and the drafter computes
exactly the rows the target computes.

With the target drafting for itself the two halves of every page must be
equal wherever the target's K/V are valid: the check below reads every
page the prefix index holds, after prefix hits, host loads and a P -> D
landing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.kv_cache import KVCache, KVShape
from pdserve.kernels.models.loader import TINY_SEED, attention_shape, build_model
from pdserve.kernels.models.model import random_weights
from pdserve.kernels.models.model_config import tiny_config
from pdserve.kernels.attention import TorchAttention
from pdserve.engine.local_pair import LocalPair
from pdserve.engine.spec.draft import check_draft_section, draft_layout
from pdserve.engine.tp.transfer import kv_layout
from pdserve.scheduler import ConfigError, EngineConfig
from pdserve.scheduler.cache.groups import SLIDING_WINDOW, CacheGroupSpec, FULL

from test_spec_draft import PROMPTS, SAME, greedy, write_noisy_tiny

# prompts that share pages at page size 4, so a later one hits an earlier one's
SHARED = [PROMPTS[0] + [60, 61, 62, 63, 64], PROMPTS[1] + [60, 61], PROMPTS[0], PROMPTS[1]]


@pytest.fixture(scope="module")
def want():
    return [o.token_ids for o in LLM(page_size=4).generate(SHARED, greedy(), use_tqdm=False)]


def cached_pages(planner, g: int = 0) -> list[int]:
    grp = planner.coord.groups[g]
    return [p for p in range(grp.pool.total) if grp.index.contains(p)]


def assert_halves_equal(executor, pages: list[int], g: int = 0) -> None:
    """The draft's layers of `pages` equal the target's (the draft is the
    target: the same tokens at the same positions give the same K/V)."""
    cache = executor.caches[g]
    n = cache.shapes[0].layers
    shape = cache.companion
    assert shape.tag                                    # the draft's weights, named
    assert dataclasses.replace(shape, tag="") == KVShape(n, cache.shapes[0].kv_heads,
                                                         cache.shapes[0].head_dim)
    assert pages
    for j in range(n):
        (tk, tv), (dk, dv) = cache.layer(j), cache.layer(n + j)
        torch.testing.assert_close(dk[pages], tk[pages], atol=1e-5, rtol=0)
        torch.testing.assert_close(dv[pages], tv[pages], atol=1e-5, rtol=0)


def test_a_page_holds_the_draft_layers_after_the_targets():
    ps = 4
    c = KVCache(2, 6, ps, 2, 8, torch.float32, "cpu", companion=KVShape(3, 1, 4))
    assert c.data.shape == (6, 2 * 2 * ps * 2 * 8 + 3 * 2 * ps * 1 * 4)
    assert c.layout() == "kv:2x2x4x2x8+3x2x4x1x4"
    k, v = c.layer(4)                           # the draft's last layer
    assert k.shape == v.shape == (6, ps, 1, 4)
    draft = c.draft_layers()
    dk, dv = draft.layer(2)
    dv[3].fill_(7.0)
    assert torch.equal(v, dv) and float(c.data[3, -1]) == 7.0   # the page's last elements
    assert float(c.data[2].abs().sum()) == 0.0                   # another page untouched
    tk, _ = c.layer(1)
    tk[3].fill_(1.0)
    back = KVCache(2, 6, ps, 2, 8, torch.float32, "cpu", companion=KVShape(3, 1, 4))
    back.write_page(5, c.read_page(3))
    assert torch.equal(back.data[5], c.data[3])
    host = KVCache(2, 4, ps, 2, 8, torch.float32, "cpu", companion=KVShape(3, 1, 4))
    host.copy_pages_from(c, [3], [0])
    assert torch.equal(host.data[0], c.data[3]) and float(host.layer(4)[1][0].sum()) == 7 * ps * 4
    with pytest.raises(ValueError, match="no second model"):
        KVCache(1, 2, ps, 1, 4, torch.float32, "cpu").draft_layers()


def test_the_target_drafting_for_itself_fills_equal_halves_through_prefix_hits(want):
    llm = LLM(speculative=SAME, page_size=4, max_scheduled_tokens=16)
    assert [o.token_ids for o in llm.generate(SHARED, greedy(), use_tqdm=False)] == want
    ex, planner = llm.executor, llm.engine.planner
    assert planner.hits.device_tokens > 0
    c = ex.spec.counts
    assert c.accepted_tokens == c.draft_tokens > 0     # no candidate lost to a stale K/V
    assert_halves_equal(ex, cached_pages(planner))
    # the draft fed no more rows than the target computed: a hit served both
    assert 0 < ex.spec.proposer.kept_rows <= ex.forward_tokens
    planner.check_invariants()
    planner.assert_idle()


def test_host_loads_bring_the_drafts_k_v_back(want):
    llm = LLM(speculative=SAME, page_size=4, total_pages=24, host_pages=64,
              max_scheduled_tokens=16)
    got = [o.token_ids for o in llm.generate(SHARED, greedy(), use_tqdm=False)]
    flush = [(7 * i + 3) % 90 + 1 for i in range(64)]      # the device pool's worth
    llm.generate([flush], greedy(), use_tqdm=False)
    again = [o.token_ids for o in llm.generate(SHARED, greedy(), use_tqdm=False)]
    assert got == again == want
    planner = llm.engine.planner
    assert planner.hits.host_tokens > 0
    c = llm.executor.spec.counts
    assert c.accepted_tokens == c.draft_tokens > 0
    assert_halves_equal(llm.executor, cached_pages(planner))
    planner.assert_idle()


def test_p_ships_the_drafts_k_v_and_d_drafts_from_them(want):
    llm = LLM()
    pd = LocalPair(llm.model, llm.tokenizer,
                   EngineConfig(page_size=4, total_pages=128, speculative=SAME))
    assert pd.generate(SHARED, greedy()) == want
    c = pd.dx.spec.counts
    assert c.accepted_tokens == c.draft_tokens > 0
    # D never fed a prompt: the pages that landed held the draft's K/V
    assert pd.dx.spec.proposer.kept_rows < sum(len(p) for p in SHARED)
    assert_halves_equal(pd.dx, cached_pages(pd.D))
    assert_halves_equal(pd.px, cached_pages(pd.P))


class FlipGate:
    """A gate that turns proposing off every other `span` rounds."""

    def __init__(self, span: int):
        self.span, self.rounds = span, 0

    @property
    def on(self) -> bool:
        return (self.rounds // self.span) % 2 == 0

    def observe(self, *args, **kw) -> None:
        self.rounds += 1


def test_the_draft_keeps_up_while_the_gate_has_proposing_off(want):
    llm = LLM(speculative=SAME, page_size=4)
    gate = llm.executor.spec.gate = FlipGate(2)
    assert [o.token_ids for o in llm.generate(SHARED, greedy(), use_tqdm=False)] == want
    c = llm.executor.spec.counts
    assert gate.rounds > 4 and c.drafts > 0
    assert c.accepted_tokens == c.draft_tokens          # after rounds off: still all kept
    assert_halves_equal(llm.executor, cached_pages(llm.engine.planner))


def test_the_draft_is_counted_in_every_page_and_in_the_layout():
    llm = LLM(speculative=SAME, page_size=4)
    plain = LLM(page_size=4)
    ex = llm.executor
    assert ex.group_bytes()[0] == 2 * plain.executor.group_bytes()[0]
    layout = kv_layout(llm.model, ex, 4)
    assert layout.draft == (ex.caches[0].companion.describe(4),)
    other = kv_layout(plain.model, plain.executor, 4)
    with pytest.raises(ValueError, match="draft model's layers in the pages"):
        layout.check_peer("decode-0", other, "prefill-0")
    assert type(layout).from_json(layout.as_json()) == layout


def _tiny(**kw):
    cfg = dataclasses.replace(tiny_config(), **kw)
    return build_model(cfg, random_weights(cfg, TINY_SEED), torch.float32, "cpu",
                       TorchAttention(**attention_shape(cfg)))


def test_a_draft_joins_only_a_group_of_its_kind():
    sliding = _tiny(sliding_window=8).cfg
    window = CacheGroupSpec(SLIDING_WINDOW, window=8)
    assert draft_layout(sliding, [FULL, window], "d").groups == (1,)
    with pytest.raises(ConfigError, match="sliding window of 8, which no cache group"):
        draft_layout(sliding, [FULL], "d")
    with pytest.raises(ConfigError, match="turn engine.sliding_replay off"):
        draft_layout(sliding, [FULL, dataclasses.replace(window, replayable=True)], "d")
    full = draft_layout(_tiny(num_layers=1).cfg, [FULL, window], "d")
    assert full.groups == (0,) and full.shapes[1] is None


def test_a_draft_of_another_dtype_is_refused():
    spec = dict(SAME, draft_model={"preset": "tiny", "dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="share the target's pages"):
        LLM(speculative=spec, dtype="float32")


def test_the_disk_tier_keeps_the_drafts_k_v_and_only_a_drafting_engine_reads_them(tmp_path,
                                                                                    want):
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}
    engine = dict(page_size=4, total_pages=48, host_pages=12)
    first = LLM(speculative=SAME, disk_cache=disk, **engine)
    assert [o.token_ids for o in first.generate(SHARED, greedy(), use_tqdm=False)] == want
    assert first.executor.disk.flush()
    first.executor.close()
    again = LLM(speculative=SAME, disk_cache=disk, **engine)      # a restart
    assert [o.token_ids for o in again.generate(SHARED, greedy(), use_tqdm=False)] == want
    assert again.engine.planner.hits.disk_tokens > 0
    c = again.executor.spec.counts
    assert c.accepted_tokens == c.draft_tokens > 0
    assert_halves_equal(again.executor, cached_pages(again.engine.planner))
    plain = LLM(disk_cache=disk, **engine)          # pages without the draft's layers
    assert [o.token_ids for o in plain.generate(SHARED, greedy(), use_tqdm=False)] == want
    assert plain.engine.planner.hits.disk_tokens == 0
    # another draft of the same shape: the pages name the draft's weights
    other = dict(SAME, draft_model={"path": str(write_noisy_tiny(tmp_path / "noisy", 0.1))})
    foreign = LLM(speculative=other, disk_cache=disk, **engine)
    assert [o.token_ids for o in foreign.generate(SHARED, greedy(), use_tqdm=False)] == want
    assert foreign.engine.planner.hits.disk_tokens == 0


def test_a_draft_that_knows_fewer_positions_than_a_request_reaches_is_refused():
    target = dataclasses.replace(tiny_config(), max_position=8192)
    short = {"preset": "tiny"}                          # 4,096 positions
    with pytest.raises(ConfigError, match="lower engine.max_context_tokens to at most 4,096"):
        check_draft_section(short, target, EngineConfig(max_context_tokens=8192))
    check_draft_section(short, target, EngineConfig(max_context_tokens=4096))
