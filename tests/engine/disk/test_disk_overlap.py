"""The disk (L3) tier with engine.overlap: a round built while the
admission round's forward runs never advances a request whose disk read
is not confirmed yet (a miss retracts it at that round's apply), so the
greedy tokens are the tier-off ones, warm, after a restart and after a
read that misses."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.engine.disk.model_match import weights_fingerprint
from pdserve.engine.disk.tier import DiskTier
from pdserve.scheduler.config import DiskCacheConfig
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer.disk.fake import FakeStore

PS = 4
# a small budget: a disk hit's prompt takes several chunks after admission
ENGINE = dict(page_size=PS, total_pages=48, host_pages=12, max_scheduled_tokens=8)
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BASE = list(range(10, 58))
TURNS = [BASE + [60 + i, 61 + i, 62 + i] + list(range(70, 82)) for i in range(2)]


def llm(overlap: bool, disk: dict | None = None) -> LLM:
    return LLM(None, **ENGINE, overlap=overlap, disk_cache=disk)


def tokens(l: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in l.generate(prompts, SP, use_tqdm=False)]


class Held:
    """Wraps an engine's planner.build: counts the rounds that found a
    prefill whose disk read was unconfirmed (built ahead of its admission
    round's apply), and checks each gave it no chunk."""

    def __init__(self, l: LLM):
        self.count = 0
        p = l.engine.planner
        build = p.build

        def watched():
            unconfirmed = {r.id for r in p.prefilling.values() if r.state.res.disk_hold >= 0}
            plan = build()
            assert not unconfirmed & {op.req.id for op in plan.prefills}
            self.count += len(unconfirmed)
            return plan
        p.build = watched


def test_overlap_serves_disk_hits_with_the_tokens_of_the_tier_off(tmp_path):
    want = tokens(llm(False), TURNS)
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}
    cold = llm(True, disk)
    assert tokens(cold, TURNS) == want
    assert cold.executor.disk.flush()
    cold.executor.close()
    again = llm(True, disk)                              # a restart on the directory
    assert tokens(again, TURNS) == want
    assert again.engine.planner.hits.disk_tokens >= 44
    again.engine.planner.assert_idle()


def test_overlap_holds_the_next_chunk_until_the_read_is_confirmed_and_a_miss_retracts():
    want = tokens(llm(False), TURNS[1:])
    store = FakeStore()
    writer = with_store(store)
    tokens(writer, TURNS[:1])
    assert writer.executor.disk.flush()
    for torn in (False, True):
        l = with_store(store, "best_effort")
        held = Held(l)
        store.faults.torn = AllChains() if torn else None
        req = Request(f"r{torn}", list(TURNS[1]), SamplingLimits(max_new_tokens=SP.max_tokens))
        l.executor.register(req.id, SP, fallback_seed=1, prompt=req.prompt.tokens)
        l.engine.submit(req)
        l.executor.disk.before_build(l.engine.planner)
        assert l.executor.disk.store.drain()
        while l.engine.has_work():
            l.engine.step()
            l.engine.planner.check_invariants()
        assert [req.output] == want
        assert held.count >= 1                           # the round built ahead waited
        hits = l.engine.planner.hits
        assert hits.disk_missed == (1 if torn else 0)
        assert (hits.disk_tokens > 0) is not torn
        l.engine.planner.assert_idle()


def with_store(store, policy: str = "wait_complete") -> LLM:
    l = llm(True)
    l.executor.disk = DiskTier(DiskCacheConfig(path="fake", prefetch_policy=policy),
                               store.reopened(),
                               model_id=weights_fingerprint(l.model), dtype="float32",
                               layout=l.executor.caches[0].layout(), page_size=PS)
    return l


class AllChains:
    """A fault set that holds every chain hash."""

    def __contains__(self, _chain) -> bool:
        return True
