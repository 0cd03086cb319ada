"""Each cache group's device pool and what one admission asks of it.

A group pairs a page pool with its prefix index and says which of a
request's table slots a forward needs: every slot for full history, the
window for a sliding group, sparse state entries (StateBlocks) for a state
group. The coordinator (coordinator.py) admits across them all at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.scheduler.cache.groups import FULL, CacheGroupSpec, StateBlocks
from pdserve.scheduler.cache.pool import PagePool
from pdserve.scheduler.cache.prefix import PrefixIndex, WindowIndex


@dataclass(frozen=True)
class GroupDemand:
    tokens: int          # the chunk's end position: pages must hold [.., tokens)
    reserve_tokens: int  # held beyond the chunk (decode slot, headroom: §1)
    begin: int = 0       # first row the next forward computes (a sliding group's window)
    lands: bool = False  # a state group: the state at `begin` arrives from a peer (§1.2)
    records: bool = True  # a state group: keep the forward's aligned checkpoint (decode: no)


class FullHistoryGroup:
    """Keeps every page of a request's history; prefix-cached by page."""

    def __init__(self, total_pages: int, page_size: int, spec: CacheGroupSpec = FULL):
        self.spec = spec
        self.page_size = page_size
        self.pool = PagePool(total_pages)
        self.index = PrefixIndex(self.pool)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def first_live(self, begin: int) -> int:
        return 0


class SlidingWindowGroup:
    """Keeps a request's last window: slots below the window of the next
    forward go back (HOLE in the table). Cached pages are named by the
    chain hash of the prefix they end (WindowIndex); a replayable group
    caches nothing (§1.3)."""

    def __init__(self, total_pages: int, page_size: int, spec: CacheGroupSpec):
        self.spec = spec
        self.page_size = page_size
        self.pool = PagePool(total_pages)
        self.index = WindowIndex(self.pool)

    def first_live(self, begin: int) -> int:
        return self.spec.first_live_page(begin, self.page_size)


class SnapshotStateGroup(StateBlocks):
    """State slots for the layers that keep a fixed-size state (spec §1.2),
    placed in a sparse table by StateBlocks' arithmetic. Entries below the
    state a forward reads go back when it is admitted (published
    checkpoints stay cached); entries it never needed are HOLE. Checkpoints
    are cached by the chain hash of the prefix they end, like sliding
    pages."""

    def __init__(self, total_slots: int, page_size: int, spec: CacheGroupSpec):
        super().__init__(spec, page_size)
        self.pool = PagePool(total_slots)
        self.index = WindowIndex(self.pool)

    def wanted(self, d: GroupDemand) -> tuple[list[int], int | None]:
        """(the entries a forward per `d` needs held, the entry it leaves an
        aligned checkpoint in, or None). A landing needs only its read
        state, which the peer sends; its mark is an aligned endpoint."""
        begin, end = d.begin, d.tokens
        want = [self.entry(begin)] if begin > 0 else []
        mark = None
        if end > begin:
            b = self.checkpoint(begin, end)
            if b:
                want.append(self.entry(b))
                mark = self.entry(b)
            want.append(self.entry(end))
            if self.aligned(end):
                mark = self.entry(end)
        elif d.lands and self.aligned(begin):
            mark = self.entry(begin)
        if not d.records:
            mark = None
        if d.reserve_tokens and end:
            last = (end - 1) // self.block
            for blk in range(last + 1, (end - 1 + d.reserve_tokens) // self.block + 1):
                want.append((blk + 1) * self.per_block - 1)
        return sorted(set(want)), mark


# what Coordinator.groups holds: their pools and indexes, and first_live, are
# alike; only a full-history group's index is a PrefixIndex (a chain)
CacheGroup = FullHistoryGroup | SlidingWindowGroup | SnapshotStateGroup


def make_group(spec: CacheGroupSpec, total_pages: int, page_size: int) -> CacheGroup:
    if spec.state:
        return SnapshotStateGroup(total_pages, page_size, spec)
    if spec.sliding:
        return SlidingWindowGroup(total_pages, page_size, spec)
    return FullHistoryGroup(total_pages, page_size, spec)
