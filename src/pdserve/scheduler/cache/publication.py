"""Publication: a request's computed pages into the prefix indexes.

As a request's slots are computed, the coordinator (coordinator.py)
publishes them: the full-history group's pages into its `PrefixIndex` under
the chain of page keys, each cached sliding group's pages and the state
group's aligned checkpoints into their `WindowIndex` under the same chain
hashes, and, with a host tier, pinned stores that copy what was published
to host (host_tier.py). Admission publishes the pages completed since the
last admission in the same all-or-nothing step (spec §2); the planner
publishes a finished prompt's and a retracted victim's.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.scheduler.cache.groups import HOLE
from pdserve.scheduler.cache.group_pools import CacheGroup
from pdserve.scheduler.cache.host_tier import HostCache, HostTier
from pdserve.scheduler.cache.pool import drop_refs
from pdserve.scheduler.cache.prefix import PrefixIndex, WindowIndex, chain_hash


class PublicationView(Protocol):
    """What publication reads of the coordinator (coordinator.py, which
    calls it): the groups and which of them cache what, and the host
    tiers its stores go to."""

    @property
    def groups(self) -> list[CacheGroup]: ...

    @property
    def full(self) -> int | None: ...

    @property
    def cached_sliding(self) -> list[int]: ...

    @property
    def state(self) -> int | None: ...

    @property
    def keyed(self) -> list[int]: ...

    @property
    def window_disk(self) -> bool: ...

    @property
    def host(self) -> HostTier | None: ...

    @property
    def hosts(self) -> list[HostTier]: ...

    @property
    def host_cache(self) -> HostCache: ...


def publish_slots(coord: PublicationView, req, res, upto: int, store: bool) -> None:
    """Put the pages of slots [published, upto) into each group's prefix
    index, in chain order, and (with a host tier, when `store`) queue
    pinned stores that copy the full-history group's to host. Where
    another page already caches the same content (two requests computed
    a shared prefix, or a hit was cut back to a state checkpoint below
    the cached chain), the request holds that page instead of its own
    and the chain goes on, unless a forward of its own is out (it may
    read its copy): then, as when the parent left the index, the chain
    ends there. A sliding group caches the pages it still holds under
    the same chain hashes, the state group the aligned checkpoints its
    forwards recorded (§1.2: only materialized boundaries, never a
    working state)."""
    if res.disk_hold >= 0:
        upto = min(upto, res.disk_hold)     # a disk read not yet confirmed
        if upto <= res.published:
            return
    ps = coord.groups[0].page_size
    sliding = [(g, coord.groups[g].index, res.tables[g]) for g in coord.cached_sliding]
    fresh_windows: list = []                    # (group, page, chain): window_disk
    state = coord.state is not None and res.marks
    if state:
        assert coord.state is not None               # `state` implies a state group
        sindex, stable, marks = coord.groups[coord.state].index, res.tables[coord.state], res.marks
    full = coord.full is not None and res.publishing
    index = coord.groups[0].index if full else None
    table = res.tables[0]
    parent, h = res.chain_tail, res.content_tail
    fresh, fresh_states = [], []
    for i in range(res.published, upto):
        key = req.page_key(i, ps)
        if coord.keyed:
            h = chain_hash(h, key)
            for g, windex, wtable in sliding:
                assert isinstance(windex, WindowIndex)  # a sliding group keys by chain hash
                if i < len(wtable) and wtable[i] != HOLE and not windex.contains(wtable[i]) \
                        and windex.insert(h, wtable[i]) and coord.window_disk:
                    fresh_windows.append((g, wtable[i], h))
            if state and i in marks:
                assert isinstance(sindex, WindowIndex)  # a state group keys by chain hash
                marks.discard(i)
                slot = stable[i] if i < len(stable) else HOLE
                if slot != HOLE and not sindex.contains(slot) and sindex.insert(h, slot):
                    fresh_states.append((slot, h))
        if full:
            assert isinstance(index, PrefixIndex)   # `full`: group 0 keeps history
            page = table[i]
            hf = index.insert(parent, key, page)
            if hf is None:
                twin = index.find(parent, key)
                if twin is None or res.forwards_out:
                    full = res.publishing = False
                    continue
                # another request cached this content first: hold its page
                # instead of ours, so the chain goes on under it
                _adopt(coord, table, i, twin)
                parent = index.hash_of(twin)
                continue
            fresh.append((page, parent, key, hf))
            parent = hf
    res.chain_tail = parent
    res.content_tail = h
    res.published = upto
    if store and fresh and coord.host is not None:
        coord.host_cache.store_published(req.id, fresh, table)
    if store and fresh_states and coord.hosts:
        coord.host_cache.store_states(req.id, fresh_states)
    if store and fresh_windows and coord.hosts:
        coord.host_cache.store_windows(req.id, fresh_windows)


def _adopt(coord: PublicationView, table: list, i: int, twin: int) -> None:
    """Slot i of the full-history table takes the cached page `twin`,
    which holds the same content; the request's own copy goes back (no
    forward of the request is out to read it)."""
    grp = coord.groups[0]
    rc = grp.pool.refcount
    if rc[twin] == 0:
        grp.index.claim(twin)
    rc[twin] += 1
    own, table[i] = table[i], twin
    drop_refs(grp.pool, grp.index, [own])
