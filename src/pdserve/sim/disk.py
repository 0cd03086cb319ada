"""The disk (L3) tier in the simulator: one store per node that every
engine shares (as engines on one directory do), with a page capacity and
read and write bandwidths.

`SimDisk` is the store: chain hashes of full-history pages, least recently
used evicted beyond `capacity_pages`. `SimDiskEdge` is one engine's edge,
with the methods the engine loop calls on a real tier (engine/disk/tier.py):
at arrival a request's probe is the run of its pages the store holds
beyond what device and host hold (instant: the read is what costs);
a plan's reads hit if their pages are still stored (one evicted since the
probe is a miss, as on a real disk) and cost pages x bytes / read bandwidth
on the round; a pinned host store of the full history is written through.
Writes run beside the rounds (their bandwidth bounds how far behind the
store may fall; the simulator does not delay them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdserve.scheduler.cache.prefix import ROOT_HASH, chain_hash


@dataclass
class DiskCounts:
    probes: int = 0
    probed_pages: int = 0
    reads_hit: int = 0
    reads_missed: int = 0
    pages_read: int = 0
    pages_written: int = 0
    evictions: int = 0


class SimDisk:
    def __init__(self, capacity_pages: int, read_gbps: float, write_gbps: float):
        self.capacity_pages = capacity_pages
        self.read_bps = read_gbps * 1e9 / 8
        self.write_bps = write_gbps * 1e9 / 8
        self.pages: OrderedDict[int, None] = OrderedDict()
        self.counts = DiskCounts()

    def put(self, chain: int) -> None:
        if chain in self.pages:
            self.pages.move_to_end(chain)
            return
        while len(self.pages) >= self.capacity_pages:
            self.pages.popitem(last=False)
            self.counts.evictions += 1
        self.pages[chain] = None
        self.counts.pages_written += 1

    def has(self, chain: int) -> bool:
        return chain in self.pages

    def touch(self, chain: int) -> None:
        self.pages.move_to_end(chain)


class SimDiskEdge:
    """One engine's view of the shared `SimDisk`."""

    def __init__(self, disk: SimDisk, page_size: int, page_bytes: int, min_hit_tokens: int = 0):
        self.disk = disk
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.min_hit_tokens = min_hit_tokens
        self._seen_seq = -1

    # ---- what the engine loop calls ------------------------------------------
    def before_build(self, planner) -> None:
        new = []
        for req in reversed(planner.waiting):
            if req.seq <= self._seen_seq:
                break
            new.append(req)
        for req in new:
            self._seen_seq = max(self._seen_seq, req.seq)
            self._probe(req, planner.cached_pages(req))

    def holding(self) -> bool:
        return False

    def wait_progress(self, timeout_s: float) -> None:
        return None

    def _probe(self, req, cached: int) -> None:
        ps = self.page_size
        pages = (req.num_tokens - 1) // ps
        if pages <= cached:
            return
        c = self.disk.counts
        c.probes += 1
        h, run = ROOT_HASH, 0
        for i in range(pages):
            h = chain_hash(h, req.page_key(i, ps))
            if i < cached:
                continue
            if not self.disk.has(h):
                break
            run += 1
        c.probed_pages += pages - cached
        if run and run * ps >= self.min_hit_tokens:
            req.disk_pages = cached + run

    # ---- what the executor calls -------------------------------------------------
    def read_seconds(self, plan, result) -> float:
        """Land the plan's disk reads in `result`; their time on the round."""
        pages = 0
        d, c = self.disk, self.disk.counts
        for op in plan.disk_loads:
            if all(d.has(h) for h in op.chains):
                for h in op.chains:
                    d.touch(h)
                result.disk_loads_done.append(op.id)
                c.reads_hit += 1
                pages += len(op.chains)
            else:
                result.disk_loads_missed.append(op.id)
                c.reads_missed += 1
        c.pages_read += pages
        return pages * self.page_bytes / d.read_bps

    def write_through(self, plan) -> None:
        for s in plan.stores:
            if s.pinned and s.group == 0 and s.entries:
                for parent, key in s.entries:
                    self.disk.put(chain_hash(parent, key))
