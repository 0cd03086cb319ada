"""The disk (L3) tier on a sliding-window model (a random-weight Gemma 3,
window 8) under bounded replay (engine.sliding_replay, §1.3): the tier
serves the full-history group's pages and a hit's first chunk recomputes
each window from them. Greedy tokens are those of the tier off, cold and
after a restart; a read that misses after admission re-prefills to the
same tokens."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.disk.model_match import weights_fingerprint
from pdserve.engine.disk.tier import DiskTier
from pdserve.scheduler.config import DiskCacheConfig
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer.disk.fake import FakeStore

from support.checkpoints import gemma3_checkpoint

pytest.importorskip("transformers")

PS = 4
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(page_size=PS, total_pages=96, sliding_pages=64, host_pages=48,
              max_scheduled_tokens=64, max_batch_size=4, sliding_replay=True)


def conversation() -> list[list[int]]:
    """Three turns of one conversation: each prompt extends the last."""
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, 128, (72,), generator=g).tolist()
    return [base[:40], base[:56], base[:72]]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    _, d = gemma3_checkpoint(tmp_path_factory.mktemp("disk-sliding"))
    return d


def serve(d, disk: dict | None = None) -> LLM:
    return LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch",
               disk_cache=disk, **ENGINE)


def one_by_one(llm: LLM, prompts) -> list[list[int]]:
    """Each prompt alone, in order (a conversation's turns)."""
    return [llm.generate([p], SP, use_tqdm=False)[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(gemma) -> list[list[int]]:
    """The tokens with no disk tier (bounded replay on, as below)."""
    return one_by_one(serve(gemma), conversation())


def test_greedy_tokens_match_tier_off_cold_and_after_restart(gemma, reference, tmp_path):
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}
    cold = serve(gemma, disk)
    assert one_by_one(cold, conversation()) == reference
    assert cold.executor.disk.flush()
    cold.executor.close()
    assert list(tmp_path.glob("*.kv"))
    again = serve(gemma, disk)                          # a restart on the same directory
    prompts = conversation()
    assert one_by_one(again, prompts[1:]) == reference[1:]
    planner = again.engine.planner
    # the second turn's 56 tokens: 13 pages a hit may cover, at least the
    # first turn's 9 full pages from disk
    assert planner.hits.disk_tokens >= 36 and planner.hits.disk_missed == 0
    assert planner.replay_tokens > 0
    assert planner.coord.groups[1].index.num_cached == 0     # windows never cached
    planner.assert_idle()


def test_a_miss_after_admission_re_prefills_to_the_same_tokens(gemma, reference):
    """best_effort admits on the probe; every file is torn by the time the
    round reads it: the request is retracted and re-prefilled, its
    window replayed from scratch, and its tokens are the tier-off ones."""
    store = FakeStore()
    writer = with_store(gemma, store)
    one_by_one(writer, conversation()[:2])
    assert writer.executor.disk.flush()
    l = with_store(gemma, store, "best_effort")
    store.faults.torn = AllChains()
    prompt = conversation()[2]
    req = Request("probed", list(prompt), SamplingLimits(max_new_tokens=SP.max_tokens))
    l.executor.register(req.id, SP, fallback_seed=1, prompt=req.prompt.tokens)
    l.engine.submit(req)
    l.executor.disk.before_build(l.engine.planner)
    assert l.executor.disk.store.drain()
    while l.engine.has_work():
        l.engine.step()
        l.engine.planner.check_invariants()
    assert req.output == reference[2]
    assert l.engine.planner.hits.disk_missed == 1
    l.engine.planner.assert_idle()


def with_store(d, store, policy: str = "wait_complete") -> LLM:
    """An engine whose disk tier is `store` (an in-memory fake, shared
    between engines like a directory)."""
    l = serve(d)
    l.executor.disk = DiskTier(DiskCacheConfig(path="fake", prefetch_policy=policy), store,
                               model_id=weights_fingerprint(l.model), dtype="float32",
                               layout=l.executor.caches[0].layout(), page_size=PS)
    return l


class AllChains:
    """A fault set that holds every chain hash."""

    def __contains__(self, _chain) -> bool:
        return True
