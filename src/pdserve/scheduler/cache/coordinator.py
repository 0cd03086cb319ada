"""The cache coordinator: admission of pages for every cache group at once,
publication, fences and release.

`admit` is all or nothing. It takes one `GroupDemand` per group (the tokens
the chunk reaches plus the reserve behind it) and the request's publication
progress; it either grants every group's pages, claims the prefix hit and
publishes the pages completed since the last admission, or changes nothing
and returns False (spec §2: "resources and publication progress land when
an admission succeeds"). What publishing a page means (which index takes
it under which key, and the host stores that copy it) is publication.py's.

Ownership of a page reference, so that every count is checkable:
  a request's block table     one ref per device page in it
  a fence                     one ref per device page a late write may reach
  a pinned store ticket       one ref on each device source and host target
  a snapshot store ticket     one ref on each host target
  a load ticket               one ref on each host source and device target
  a retracted snapshot        one ref on each host page it holds
A ticket lets go at its copy's ack, however many rounds later: a page an
unacked copy reads or writes is never free, nor granted to anyone else.

Groups (cache_groups.py): at most one full-history group, first when there
is one, then sliding-window groups, then at most one snapshot-state group.
A sliding group's table keeps absolute slots and lets go of the pages below
the window of the forward it is admitted for; its admission counts those as
available. A state group's table is sparse (`SnapshotStateGroup`); the
groups' pools are in group_pools.py. The prefix hit is the longest one
every group can serve (`match`, hit.py); admission claims it.

The host (L2) tier and the tickets of copies to and from it live in
host_tier.py (`HostCache`): it caches the full-history group's pages and the
state group's checkpoints for prefix hits, and snapshots every group's on
retraction. The coordinator makes its publication stores as it publishes
and its loads as it admits a host hit, and passes the planner's snapshot
and ack calls through, so the planner sees one object.

The disk (L3) tier is an edge the coordinator never reads (it serves the
full-history group, beside replayable sliding groups, cached ones whose
window tail at the hit's end is read with the pages (`window_disk`: their
published pages are stored to host for the disk), or a state group, whose
checkpoint at the hit's end is read with the pages; `serves_disk`):
a request carries what the engine's probe found (`Request.disk_pages`), and
`disk_hit` (disk_hit.py) continues a hit over those pages, shortened to the host pages
that could stage them and rounded down to the prefix granularity (spec
§1). Admission reads them disk -> host -> device in the round; until the
read is confirmed, publication stops below them (`Resources.disk_hold`),
so a miss publishes nothing empty (§4).
"""

from __future__ import annotations

from pdserve.scheduler.cache.groups import HOLE
from pdserve.scheduler.cache.disk_hit import continue_on_disk
from pdserve.scheduler.cache.group_pools import CacheGroup, GroupDemand
from pdserve.scheduler.cache.hit import Hit, longest_hit
from pdserve.scheduler.cache.host_tier import HostCache, HostTier
from pdserve.scheduler.plan import StoreOp
from pdserve.scheduler.cache.pool import PoolError, check_refcounts, drop_refs
from pdserve.scheduler.cache.prefix import ROOT_HASH, chain_hash
from pdserve.scheduler.cache.publication import publish_slots


def chain_hashes(req, pages: int, page_size: int) -> list[int]:
    """The chain hash of each of the first `pages` prompt pages of `req`."""
    h, out = ROOT_HASH, []
    for i in range(pages):
        h = chain_hash(h, req.page_key(i, page_size))
        out.append(h)
    return out


class Coordinator:
    def __init__(self, groups: list[CacheGroup], host_pages: int = 0,
                 host_slots: int = 0):
        """`host_pages`: each page group's host tier (0: none); `host_slots`:
        a state group's (0: as many as its device pool)."""
        if not groups:
            raise ValueError("a coordinator needs at least one cache group")
        full = [i for i, g in enumerate(groups) if g.spec.keeps_history]
        if full not in ([], [0]):
            raise ValueError("at most one full-history cache group, and it comes first")
        self.groups = groups
        self.page_size = groups[0].page_size
        self.full = 0 if full else None
        # admission order: the full history, then publication, then the others
        self._order = full + [None] + [g for g in range(len(groups)) if g not in full]
        self.cached_sliding = [i for i, g in enumerate(groups)
                               if g.spec.sliding and not g.spec.replayable]
        self.state = next((i for i, g in enumerate(groups) if g.spec.state), None)
        # groups whose cached entries are named by the chain hash
        self.keyed = self.cached_sliding + ([self.state] if self.state is not None else [])
        # a disk tier stores the cached sliding groups' window tails: their
        # published pages are stored to host (so written to disk) and a disk
        # hit reads the tail at its end (set by the planner, engine.disk_cache)
        self.window_disk = False
        self.host_cache = HostCache(groups, host_pages, host_slots)
        self.fences: dict = {}                      # key -> per group, device pages a late write may reach
        # fences of bundles released while their loads were in flight: key -> load ids left
        self._awaiting_loads: dict = {}
        self._released_early = 0
        # The last refused admission: (pages it needed from the pool, pages
        # free then, evictable cached ones included), in the group that
        # refused. Read by waiting.py only.
        self.refused: tuple[int, int] = (0, 0)

    # ---- the host tier (host_tier.py), as the planner sees it -------------
    @property
    def hosts(self) -> list[HostTier]:
        """A host tier per group (a state group's holds state slots); none
        without host_pages."""
        return self.host_cache.tiers

    @property
    def host(self) -> HostTier | None:
        """The full-history group's host tier (group 0's)."""
        return self.host_cache.tiers[0] if self.host_cache.tiers else None

    @property
    def pending_stores(self) -> list[StoreOp]:
        """Stores made, not yet handed to a plan."""
        return self.host_cache.pending_stores

    @property
    def stores(self) -> dict:
        """Stores handed out (and pending), not yet acked."""
        return self.host_cache.stores

    @property
    def loads(self) -> dict:
        return self.host_cache.loads

    def pinned_stores_outstanding(self) -> int:
        return self.host_cache.pinned_stores_outstanding()

    def take_pending_stores(self) -> list[StoreOp]:
        return self.host_cache.take_pending_stores()

    def snapshot(self, req_id: str, res, pages: int, plan) -> list | None:
        return self.host_cache.snapshot(req_id, res, pages, plan)

    def load_snapshot(self, req_id: str, res, snap: list, start: int, plan) -> None:
        self.host_cache.load_snapshot(req_id, res, snap, start, plan)

    def release_snapshot(self, snap: list) -> None:
        self.host_cache.release_snapshot(snap)

    def store_done(self, op_id: int) -> None:
        self.host_cache.store_done(op_id)

    def store_failed(self, op_id: int) -> None:
        self.host_cache.store_failed(op_id)

    def load_done(self, op_id: int) -> None:
        """A load landed (or failed): its ticket lets go, and a bundle
        released while its loads were in flight goes with the last one."""
        self.host_cache.load_done(op_id)
        for key, ids in list(self._awaiting_loads.items()):
            ids.discard(op_id)
            if not ids:
                del self._awaiting_loads[key]
                self.release_fence(key)

    # ---- queries (pure) --------------------------------------------------
    def available_pages(self, g: int = 0) -> int:
        """Pages an admission could take now: free plus idle cached."""
        grp = self.groups[g]
        return grp.pool.num_free + grp.index.num_idle

    def page_is_held(self, g: int, page: int, host: bool = False) -> bool:
        """Does anyone (a request, ticket, fence or snapshot) hold `page` of
        group g's device pool (its host tier's, `host`)? A page nobody
        holds is free, or cached and evictable: an admission may take it."""
        pool = self.host_cache.tiers[g].pool if host else self.groups[g].pool
        return pool.refcount[page] > 0

    def free_pages(self) -> int:
        """Group 0's pages no request holds or pins (evictable cached count)."""
        return self.available_pages(0)

    def match(self, req, max_pages: int, sliding: bool = True, use_host: bool = True) -> Hit:
        """The longest cached prefix of at most max_pages pages that every
        group can serve (hit.py). Pure."""
        return longest_hit(self, req, max_pages, sliding, use_host)

    @property
    def serves_disk(self) -> bool:
        """Can a disk hit be read here: a full-history group (the tier
        caches its pages, and a state group's checkpoints), cached sliding
        groups only where the tier stores their tails (`window_disk`), and
        a host tier to stage through. Replayable sliding groups (§1.3) are served: a
        hit's first chunk recomputes their windows from the full-history
        pages the disk filled. A state group's disk hit ends exactly where
        the probe found a checkpoint (§1.2), read with the pages."""
        return self.full == 0 and (not self.cached_sliding or self.window_disk) \
            and self.host is not None

    @property
    def landing_serves_disk(self) -> bool:
        """Can D's remote admission read its own tiers (host and disk)
        and ask the peer for the rest: wherever a disk hit can be read.
        The peer sends each sliding group's last window and the state
        group's final state whatever D's hit (`transfer_slots`), so D's
        hit needs the full history's pages only: its windows are never
        replayed nor its checkpoint read (`disk_hit`'s `landing`)."""
        return self.serves_disk

    def disk_hit(self, req, hit: Hit, max_pages: int, granularity: int,
                 landing: bool = False) -> Hit:
        """`hit` continued over the pages the disk tier holds beyond it
        (disk_hit.py). Pure."""
        return continue_on_disk(self, req, hit, max_pages, granularity, landing)

    def window_tail(self, g: int, end: int) -> range:
        """The slots of sliding group g the first query after a hit ending
        at page `end` reads."""
        return range(self.groups[g].first_live(end * self.page_size), end)

    def disk_chains(self, req, hit: Hit) -> list[int]:
        """The chain hash of each disk page of `hit`: the disk tier's key
        of the prefix the page ends."""
        h = ROOT_HASH
        out = []
        first = hit.pages - hit.disk
        for i in range(hit.pages):
            h = chain_hash(h, req.page_key(i, self.page_size))
            if i >= first:
                out.append(h)
        return out

    # ---- admission -------------------------------------------------------
    def admit(self, req, res, demands: list[GroupDemand], publish_pages: int, plan,
              hit: Hit | None = None) -> bool:
        """Grant every group's demand, claim the device part of `hit`, load
        its host part, publish the pages up to `publish_pages`, let each
        sliding group's slots below its window go (a state group's below the
        state its forward reads) and record the state checkpoint the forward
        will materialize; or change nothing and return False. Slots a group
        lets go count as available to the same admission."""
        fresh_hit = bool(hit is not None and not res.tables[0] and hit.pages)
        grants = self._grants(res, demands, hit if fresh_hit else None)
        if grants is None:
            return False
        if hit is not None and (hit.host or hit.disk) and \
                len(hit.host) + hit.disk > grants[0][0]:
            raise PoolError("a host or disk hit beyond the admitted pages")
        if fresh_hit:
            assert hit is not None                  # a fresh hit is a hit
            self._claim(res, hit)
        self._apply_grants(req, res, grants, publish_pages, plan, hit, fresh_hit)
        tables = res.tables
        slots_held = len(tables[0]) if len(tables) == 1 else min(len(t) for t in tables)
        req.capacity = slots_held * self.page_size
        return True

    def _grants(self, res, demands: list[GroupDemand], hit: Hit | None) -> list | None:
        """Each group's grant (`_grant`) for its demand and the device part
        of a fresh `hit`, or None if a group's pools cannot supply it: free
        and idle cached pages, less the idle ones the hit claims, plus the
        slots the admission lets go. A refusal is noted in `refused`."""
        grants = []
        for g, (grp, demand) in enumerate(zip(self.groups, demands)):
            table = res.tables[g]
            hit_pages = hit.device[g] if hit is not None else ()
            hit_first = hit.first[g] if hit is not None and hit_pages else 0
            grant = self._grant(grp, table, demand, hit_pages, hit_first)
            need, lo = grant[0], grant[1]
            grants.append(grant)
            if not need:
                continue
            avail = grp.pool.num_free + grp.index.num_idle
            claimed_idle = 0
            if hit_pages:
                rc = grp.pool.refcount
                claimed_idle = sum(1 for p in hit_pages if rc[p] == 0)
                avail -= claimed_idle
            if lo:
                rc = grp.pool.refcount
                avail += sum(1 for p in table[:lo] if p != HOLE and rc[p] == 1)
            if need > avail:
                # its own idle hit pages count once on each side, as free_pages() shows them
                self.refused = (need + claimed_idle, avail + claimed_idle)
                return None
        return grants

    def _apply_grants(self, req, res, grants: list, publish_pages: int, plan,
                      hit: Hit | None, fresh_hit: bool) -> None:
        """Carry out granted admission group by group: the full history
        grows first (a host hit's pages are published with it, their loads
        queued); then publication; then the sliding groups let go and grow,
        and the state group places its slots, loads a host checkpoint and
        marks the one its forward will record."""
        for g in self._order:
            if g is None:
                if publish_pages > res.published:
                    publish_slots(self, req, res, publish_pages, store=True)
                continue
            grp, table = self.groups[g], res.tables[g]
            need, lo, entries, mark = grants[g]
            if lo:
                self._let_go(grp, table, lo)
            if grp.spec.state:
                if need:
                    self._place(table, entries, self._allocate(grp, need))
                if fresh_hit and hit is not None and hit.state_host >= 0:
                    # the hit's checkpoint from host into the slot its forward reads
                    self.host_cache.load(req.id, g, [hit.state_host], [table[hit.pages - 1]],
                                         plan)
                elif fresh_hit and hit is not None and hit.state_disk:
                    # the hit's checkpoint from disk, through a host slot
                    self.host_cache.load_from_disk(req.id, [self.disk_chains(req, hit)[-1]],
                                                   hit.pages - 1, [table[hit.pages - 1]],
                                                   plan, group=g)
                if mark is not None:
                    res.marks.add(mark)
                continue
            if not need:
                continue
            pages = self._allocate(grp, need)
            if fresh_hit and hit is not None and hit.window_disk and g in self.cached_sliding:
                # the window's tail at the hit's end from disk, through host pages
                tail = self.window_tail(g, hit.pages)
                assert len(table) == tail.start     # its slots are the first granted
                hashes = chain_hashes(req, hit.pages, self.page_size)
                self.host_cache.load_from_disk(req.id, [hashes[i] for i in tail], tail.start,
                                               pages[:len(tail)], plan, group=g)
            if g == 0 and hit is not None and hit.host:
                self.host_cache.load(req.id, 0, list(hit.host), pages[:len(hit.host)], plan)
            if g == 0 and fresh_hit and hit is not None and hit.disk:
                nh = len(hit.host)
                self.host_cache.load_from_disk(req.id, self.disk_chains(req, hit),
                                               hit.pages - hit.disk,
                                               pages[nh:nh + hit.disk], plan)
                res.disk_hold = hit.pages - hit.disk
            table.extend(pages)
            plan.fresh_pages.extend(pages)

    @staticmethod
    def _grant(grp, table: list, demand: GroupDemand, hit_pages, hit_first: int) -> tuple:
        """(pages the group must allocate for `demand`, the slot below which
        its table lets go, and for a state group the entries the new slots
        fill and the entry left holding an aligned checkpoint, or None)."""
        lo = grp.first_live(demand.begin)
        if grp.spec.state:
            want, mark = grp.wanted(demand)
            held = {i for i in want if i < len(table) and table[i] != HOLE}
            if hit_pages:
                held.add(hit_first)
            missing = [i for i in want if i not in held]
            return len(missing), lo, missing, mark
        cur = len(table) if table else hit_first + len(hit_pages)
        need = -(-(demand.tokens + demand.reserve_tokens) // grp.page_size) - max(cur, lo)
        return max(need, 0), lo, (), None

    @staticmethod
    def _place(table: list, entries: list, slots: list) -> None:
        """Put `slots` at `entries` of a sparse (state) table."""
        if len(table) <= entries[-1]:
            table.extend([HOLE] * (entries[-1] + 1 - len(table)))
        for i, slot in zip(entries, slots):
            table[i] = slot

    def _claim(self, res, hit: Hit) -> None:
        """Take a reference on every device page of the hit, in slot order."""
        for g, grp in enumerate(self.groups):
            pages = hit.device[g]
            if not pages:
                continue
            rc, index, table = grp.pool.refcount, grp.index, res.tables[g]
            table.extend([HOLE] * hit.first[g])
            for p in pages:
                if rc[p] == 0:
                    index.claim(p)
                rc[p] += 1
                table.append(p)
        res.published = hit.device_end
        res.content_tail = hit.tail
        if self.full is not None:
            res.chain_tail = hit.tail

    def trim(self, res, begin: int) -> None:
        """Let each sliding group go of the slots below the window of a row
        at `begin`, the state group of all but the state there (P, shipping
        a prompt: only the window and the final state travel)."""
        for grp, table in zip(self.groups, res.tables):
            if not grp.spec.keeps_history:
                lo = grp.first_live(begin)
                if lo:
                    self._let_go(grp, table, lo)

    @staticmethod
    def _let_go(grp, table: list, lo: int) -> None:
        """A sliding group's slots below `lo` hold nothing the next forward
        reads: drop them (HOLE), padding a table that starts above them."""
        if len(table) < lo:
            table.extend([HOLE] * (lo - len(table)))
        gone = [p for p in table[:lo] if p != HOLE]
        if gone:
            drop_refs(grp.pool, grp.index, gone)
            for i in range(lo):
                table[i] = HOLE

    def _allocate(self, grp: CacheGroup, n: int) -> list[int]:
        short = n - grp.pool.num_free
        if short > 0:
            for p in grp.index.evict(short):
                grp.pool.put_free(p)
        return grp.pool.take(n)

    # ---- publication (publication.py) --------------------------------------
    def publish(self, req, res, upto: int, store: bool = True) -> None:
        if upto > res.published:
            publish_slots(self, req, res, upto, store)


    # ---- fences ------------------------------------------------------------
    def fence(self, key, res) -> None:
        """Keep a bundle's pages held under `key` instead of releasing them:
        a posted write may still land in them (transfer/landing.py)."""
        if key in self.fences:
            raise PoolError(f"fence {key!r} exists")
        self.fences[key] = [[p for p in t if p != HOLE] for t in res.tables]
        for t in res.tables:
            t.clear()

    def release_fence(self, key) -> None:
        for grp, pages in zip(self.groups, self.fences.pop(key)):
            drop_refs(grp.pool, grp.index, reversed(pages))

    def fenced_pages(self) -> int:
        return sum(len(pages[0]) for pages in self.fences.values())


    # ---- release ---------------------------------------------------------
    def release(self, res, owner: str | None = None) -> None:
        """Drop the request's hold on every page, deepest first, so that the
        deepest pages carry the oldest LRU stamps. If loads of `owner` (its
        request) are in flight, the bundle is fenced until the last one is
        acked instead: a load's targets sit in its table's prefix chain, and
        a held page may not hang under an idle parent in the index."""
        loads = {ld.id for ld in self.host_cache.loads.values() if ld.req_id == owner} \
            if owner is not None and self.host_cache.loads else None
        if loads:
            self._released_early += 1
            key = ("loads in flight", owner, self._released_early)
            self.fence(key, res)
            self._awaiting_loads[key] = loads
            res.marks.clear()
            return
        for grp, table in zip(self.groups, res.tables):
            drop_refs(grp.pool, grp.index, [p for p in reversed(table) if p != HOLE])
            table.clear()
        res.marks.clear()

    # ---- invariants ------------------------------------------------------
    def check_invariants(self, live_tables: list, snapshots: list | None = None,
                         live_ids: list | None = None) -> None:
        """free + cached + held == total in every pool, and every refcount
        equals the references its owners (tables, fences, tickets,
        snapshots) hold; the host pools are the host cache's to check.
        `live_ids`: the request of each of `live_tables`, to check that no
        page an unacked load writes is anyone else's (host_tier.py)."""
        for g, grp in enumerate(self.groups):
            expected = [0] * grp.pool.total
            for tables in live_tables:
                for p in tables[g]:
                    if p != HOLE:
                        expected[p] += 1
            for p in self.host_cache.held_device_pages(g):
                expected[p] += 1
            for pages in self.fences.values():
                for p in pages[g]:
                    expected[p] += 1
            check_refcounts(f"group {g}", grp.pool, grp.index, expected)
        self.host_cache.check_invariants(snapshots)
        if live_ids is not None:
            self.host_cache.check_copies(dict(zip(live_ids, live_tables)))
