"""A cached sliding window through the disk (L3) tier: a random-weight
Gemma 3 (window 8) served without replay. Its window pages, stored to host
and written through beside the full-history pages of the same prefix,
read back byte for byte; a disk hit reads the window's tail at its end
with the pages, and greedy tokens are the tier-off ones cold, after a
restart and after a tail read that misses."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.disk.groups import WindowFiles
from pdserve.engine.disk.model_match import weights_fingerprint
from pdserve.engine.disk.tier import DiskTier
from pdserve.scheduler.config import DiskCacheConfig
from pdserve.scheduler.plan import DiskLoadOp, Plan, StepResult, StoreOp
from pdserve.scheduler.cache.prefix import ROOT_HASH, chain_hash
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer.disk.fake import FakeStore
from pdserve.transfer.disk.store import DiskOp

from support.checkpoints import gemma3_checkpoint

pytest.importorskip("transformers")

PS = 4
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    _, d = gemma3_checkpoint(tmp_path_factory.mktemp("disk-window"))
    return d


def cached_windows(d, store, engine: dict | None = None,
                   policy: str = "wait_complete") -> tuple[LLM, WindowFiles]:
    """A Gemma 3 engine without replay (its windows cached) whose disk tier
    is `store` and stores the sliding group's tails. `engine`: with
    engine.disk_cache's planner (window pages stored to host as published,
    a hit's tail read) when given, the tier's half alone when not."""
    kw = engine or dict(page_size=PS, total_pages=96, sliding_pages=64, host_pages=48,
                        max_scheduled_tokens=64, max_batch_size=4)
    disk = DiskCacheConfig(path="fake", prefetch_policy=policy)
    l = LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", **kw)
    if engine is not None:          # the planner of an engine with a disk tier
        l.engine.planner.coord.window_disk = True
    ex = l.executor
    g = next(i for i, grp in enumerate(ex.groups) if grp.sliding)
    wf = WindowFiles(g, ex.groups[g].window, ex.caches[g].layout())
    ex.disk = DiskTier(disk, store, model_id=weights_fingerprint(l.model),
                       dtype="float32", layout=ex.caches[0].layout(), page_size=PS,
                       windows=(wf,))
    return l, wf


def chains(prompt: list[int], pages: int) -> list[int]:
    req, h, out = Request("x", list(prompt)), ROOT_HASH, []
    for i in range(pages):
        h = chain_hash(h, req.page_key(i, PS))
        out.append(h)
    return out


def test_a_window_tail_round_trips_byte_equal_beside_its_full_history_pages(gemma):
    store = FakeStore()
    l, wf = cached_windows(gemma, store)
    ex, g = l.executor, wf.group
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(11)).tolist()
    l.generate([prompt], SP, use_tqdm=False)
    assert ex.disk.flush()
    hs = chains(prompt, len(prompt) // PS)
    windex = l.engine.planner.coord.groups[g].index
    # the longest hit whose window tail the device still caches
    end = max(e for e in range(1, len(hs) + 1)
              if all(windex.find(hs[i]) is not None for i in wf.tail(e, PS)))
    tail = wf.tail(end, PS)
    assert len(tail) >= 2 and end >= 8
    device = [windex.find(hs[i]) for i in tail]
    staged = list(range(len(tail)))                     # host pages of the sliding group
    ex.hosts[g].copy_pages_from(ex.caches[g], device, staged)
    write = Plan(0, stores=[StoreOp(1, "x", device, staged, True, [hs[i] for i in tail],
                                    group=g)])
    assert not ex.disk.copies(write, StepResult(), ex.hosts[0], None, ex.hosts)
    assert ex.disk.flush()
    # the full-history pages of the same prefix went to disk as the run stored them
    for h in hs[:end]:
        assert store.wait(store.submit(DiskOp.EXISTS, ex.disk.key(h)), 10).ok
    back = list(range(len(tail), 2 * len(tail)))       # other host pages, read into
    result = StepResult()
    read = Plan(1, disk_loads=[DiskLoadOp(2, "y", [hs[i] for i in tail], back, tail.start, g)])
    assert not ex.disk.copies(read, result, ex.hosts[0], None, ex.hosts)
    assert result.disk_loads_done == [2]
    for b, d in zip(back, device):
        assert ex.hosts[g].read_page(b) == ex.caches[g].read_page(d)
    # a full-history page's file is not a window's: a tail read of a page
    # whose window was never written misses
    missed = StepResult()
    read = Plan(2, disk_loads=[DiskLoadOp(3, "z", [hs[0]], [back[0]], 0, g)])
    assert ex.disk.copies(read, missed, ex.hosts[0], None, ex.hosts) == {"z"}
    assert missed.disk_loads_missed == [3]


ENGINE = dict(page_size=PS, total_pages=96, sliding_pages=64, host_pages=48,
              max_scheduled_tokens=64, max_batch_size=4)


def conversation() -> list[list[int]]:
    """Three turns of one conversation: each prompt extends the last."""
    g = torch.Generator().manual_seed(11)
    base = torch.randint(3, 128, (72,), generator=g).tolist()
    return [base[:40], base[:56], base[:72]]


def one_by_one(llm: LLM, prompts) -> list[list[int]]:
    return [llm.generate([p], SP, use_tqdm=False)[0].token_ids for p in prompts]


def test_a_disk_hit_reads_each_windows_tail_without_replay(gemma, tmp_path):
    """Cached windows (no sliding_replay): the tier stores the window pages
    as they are published, and a disk hit reads the tail at its end with
    the full-history pages; greedy tokens are the tier-off ones cold and
    after a restart, and nothing is replayed."""
    def serve(disk=None) -> LLM:
        return LLM({"model": {"path": str(gemma)}}, dtype="float32", attention="torch",
                   disk_cache=disk, **ENGINE)
    reference = one_by_one(serve(), conversation())
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}
    cold = serve(disk)
    assert one_by_one(cold, conversation()) == reference
    assert cold.executor.disk.flush()
    cold.executor.close()
    again = serve(disk)                                 # a restart on the same directory
    reads = recording_reads(again)
    assert one_by_one(again, conversation()[1:]) == reference[1:]
    planner = again.engine.planner
    # the second turn's 56 tokens: at least the first turn's 9 full pages
    # from disk, and the window's tail at the hit's end beside them
    assert planner.hits.disk_tokens >= 36 and planner.hits.disk_missed == 0
    g = next(i for i, grp in enumerate(again.executor.groups) if grp.sliding)
    tail_reads = [op for op in reads if op.group == g]
    assert tail_reads and all(len(op.chains) == 2 for op in tail_reads)   # window 8: 2 pages
    assert planner.replay_tokens == 0
    planner.check_invariants()
    planner.assert_idle()


def recording_reads(l: LLM) -> list:
    """The DiskLoadOps of every round `l`'s disk tier carries out."""
    reads: list = []
    tier = l.executor.disk
    copies = tier.copies

    def recorded(plan, *args, **kw):
        reads.extend(plan.disk_loads)
        return copies(plan, *args, **kw)
    tier.copies = recorded
    return reads


def test_a_tail_read_that_misses_re_prefills_to_the_same_tokens(gemma):
    """best_effort admits on the probe; every file is torn by the time the
    round reads it (pages and tails): the request is retracted and
    re-prefilled, and its tokens are the tier-off ones."""
    store = FakeStore()
    writer, _ = cached_windows(gemma, store, ENGINE)
    reference = one_by_one(writer, conversation())
    assert writer.executor.disk.flush()
    l, _ = cached_windows(gemma, store, ENGINE, "best_effort")
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


class AllChains:
    """A fault set that holds every chain hash."""

    def __contains__(self, _chain) -> bool:
        return True
