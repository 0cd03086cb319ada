"""The disk (L3) tier on a state model (a random-weight Qwen3.5: Gated
DeltaNet layers beside full attention, state checkpoints every 8 tokens):
the tier stores the full-history pages and the state checkpoints, and a
disk hit ends at a checkpoint the disk holds, its pages and that state
read together (§1.2). Greedy tokens are the tier-off ones cold, after a
restart and after a read that misses; a checkpoint round-trips byte-equal
through the engine's own files."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.disk.model_match import weights_fingerprint
from pdserve.engine.disk.tier import DiskTier
from pdserve.scheduler.config import DiskCacheConfig
from pdserve.scheduler.cache.prefix import ROOT_HASH, chain_hash
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer.disk.fake import FakeStore
from pdserve.transfer.disk.store import DiskOp

from support.checkpoints import qwen3_5_checkpoint

pytest.importorskip("transformers")

PS = 4
BLOCK = 8
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ENGINE = dict(page_size=PS, total_pages=96, host_pages=48, max_scheduled_tokens=64,
              max_batch_size=4, state_block=BLOCK)


def conversation() -> list[list[int]]:
    """Three turns of one conversation: each prompt extends the last."""
    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, 128, (70,), generator=g).tolist()
    return [base[:37], base[:53], base[:70]]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    _, d = qwen3_5_checkpoint(tmp_path_factory.mktemp("disk-state"))
    return d


def serve(d, disk: dict | None = None) -> LLM:
    return LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch",
               disk_cache=disk, **ENGINE)


def one_by_one(llm: LLM, prompts) -> list[list[int]]:
    return [llm.generate([p], SP, use_tqdm=False)[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(qwen) -> list[list[int]]:
    return one_by_one(serve(qwen), conversation())


def test_greedy_tokens_match_tier_off_cold_and_after_restart(qwen, reference, tmp_path):
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}
    cold = serve(qwen, disk)
    assert one_by_one(cold, conversation()) == reference
    assert cold.executor.disk.flush()
    cold.executor.close()
    again = serve(qwen, disk)                            # a restart on the same directory
    assert one_by_one(again, conversation()[1:]) == reference[1:]
    planner = again.engine.planner
    # the second turn (53 tokens) resumes at a checkpoint the first turn
    # wrote: 32 tokens (37 tokens published 9 pages; checkpoints every 8)
    assert planner.hits.disk_tokens >= 32 and planner.hits.disk_missed == 0
    assert again.executor.disk.counts.reads_hit >= 2     # pages and a checkpoint
    planner.assert_idle()


def test_a_checkpoint_round_trips_byte_equal_through_the_engines_files(qwen):
    """Every checkpoint of the first turn the host tier caches is on disk
    under its chain hash, byte for byte the host slot it was written from."""
    store = FakeStore()
    l = with_store(qwen, store)
    prompt = conversation()[0]
    one_by_one(l, [prompt])
    ex = l.executor
    assert ex.disk.flush()
    index = l.engine.planner.coord.hosts[ex.state].index
    req = Request("x", list(prompt))
    h, found = ROOT_HASH, 0
    for i in range(len(prompt) // PS):
        h = chain_hash(h, req.page_key(i, PS))
        slot = index.find(h)
        if slot is None:
            continue
        d = store.wait(store.submit(DiskOp.GET, ex.disk.key(h, ex.state)), 10)
        assert d.ok and d.data == ex.hosts[ex.state].read_slot(slot)
        found += 1
    assert found >= 1


def test_a_miss_after_admission_re_prefills_to_the_same_tokens(qwen, reference):
    store = FakeStore()
    writer = with_store(qwen, store)
    one_by_one(writer, conversation()[:2])
    assert writer.executor.disk.flush()
    l = with_store(qwen, store, "best_effort")
    store.faults.torn = AllChains()
    req = Request("probed", list(conversation()[2]), SamplingLimits(max_new_tokens=SP.max_tokens))
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
    l = serve(d)
    ex = l.executor
    ex.disk = DiskTier(DiskCacheConfig(path="fake", prefetch_policy=policy), store,
                       model_id=weights_fingerprint(l.model), dtype="float32",
                       layout=ex.caches[0].layout(), page_size=PS, state=ex.state_files())
    return l


class AllChains:
    def __contains__(self, _chain) -> bool:
        return True


def test_selective_writes_put_the_checkpoint_with_the_pages_and_a_restart_hits_it(
        qwen, reference, tmp_path):
    """write_through_selective: a page run is written at its first host hit
    (write_hits 1), and so is the checkpoint that ends it, so after a
    restart the next turn resumes from disk with the tier-off tokens."""
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete",
            "write_policy": "write_through_selective", "write_hits": 1}
    small = dict(ENGINE, total_pages=24)
    first = LLM({"model": {"path": str(qwen)}}, dtype="float32", attention="torch",
                disk_cache=disk, **small)
    turns = conversation()
    assert one_by_one(first, turns[:1]) == reference[:1]
    assert first.executor.disk.flush() and not list(tmp_path.glob("*.kv"))
    one_by_one(first, [filler()])                        # the first turn leaves the device
    assert one_by_one(first, turns[1:2]) == reference[1:2]  # a host hit: now written
    assert first.engine.planner.hits.host_tokens >= 32   # the whole hit from host
    assert first.executor.disk.flush()
    first.executor.close()
    again = serve(qwen, disk)                            # a restart on the same directory
    assert one_by_one(again, turns[1:]) == reference[1:]
    planner = again.engine.planner
    assert planner.hits.disk_tokens >= 32 and planner.hits.disk_missed == 0
    assert again.executor.disk.counts.reads_hit >= 2     # pages and a checkpoint
    planner.assert_idle()


def filler() -> list[int]:
    """A prompt sharing nothing with the conversation, long enough to
    evict it from a 24-page device pool."""
    return [1] + [(7 * i) % 100 + 20 for i in range(87)]
