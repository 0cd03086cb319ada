"""A sliding-window group's window tail through the disk (L3) tier, at the
tier's level: a random-weight Gemma 3 (window 8) served without replay
caches each window's tail on device under the chain hash of the prefix a
page ends; those pages, stored to host and written through beside the
full-history pages of the same prefix, read back byte for byte into other
host pages. The planner does not make these stores and reads yet (the
engine refuses a disk tier for cached windows by name); this is the tier's
half of serving them."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.roles.disk_tier import DiskTier, WindowFiles, weights_fingerprint
from pdserve.scheduler.config import ConfigError, DiskCacheConfig
from pdserve.scheduler.plan import DiskLoadOp, Plan, StepResult, StoreOp
from pdserve.scheduler.prefix import ROOT_HASH, chain_hash
from pdserve.scheduler.request import Request
from pdserve.transfer.disk_fake import FakeStore
from pdserve.transfer.disk_store import DiskOp

from test_gemma3 import gemma3_checkpoint

pytest.importorskip("transformers")

PS = 4
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    _, d = gemma3_checkpoint(tmp_path_factory.mktemp("disk-window"))
    return d


def cached_windows(d, store) -> tuple[LLM, WindowFiles]:
    """A Gemma 3 engine without replay (its windows cached) whose disk tier
    is `store` and stores the sliding group's tails."""
    l = LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", page_size=PS,
            total_pages=96, sliding_pages=64, host_pages=48, max_scheduled_tokens=64,
            max_batch_size=4)
    ex = l.executor
    g = next(i for i, grp in enumerate(ex.groups) if grp.sliding)
    wf = WindowFiles(g, ex.groups[g].window, ex.caches[g].layout())
    ex.disk = DiskTier(DiskCacheConfig(path="fake"), store, model_id=weights_fingerprint(l.model),
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


def test_an_engine_refuses_a_disk_tier_for_cached_windows_by_name(gemma, tmp_path):
    """Until the planner reads tails at a hit, an engine with cached windows
    and engine.disk_cache is refused at start, naming the fix."""
    with pytest.raises(ConfigError, match="window 8.*sliding_replay: true"):
        LLM({"model": {"path": str(gemma)}}, dtype="float32", attention="torch", page_size=PS,
            total_pages=96, sliding_pages=64, host_pages=48, max_scheduled_tokens=64,
            disk_cache={"path": str(tmp_path)})
