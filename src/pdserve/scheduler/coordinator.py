"""The cache coordinator: admission of pages for every cache group at once,
publication, the host (L2) tier, and the tickets of copies in flight.

`admit` is all or nothing. It takes one `GroupDemand` per group (the tokens
the chunk reaches plus the reserve behind it) and the request's publication
progress; it either grants every group's pages, claims the prefix hit and
publishes the pages completed since the last admission, or changes nothing
and returns False (spec §2: "resources and publication progress land when
an admission succeeds").

Ownership of a page reference, so that every count is checkable:
  a request's block table     one ref per device page in it
  a pinned store ticket       one ref on each device source and host target
  a load ticket               one ref on each host source
  a retracted snapshot        one ref on each host page it holds

Groups (cache_groups.py): at most one full-history group, first when there
is one, then sliding-window groups, then at most one snapshot-state group.
A sliding group's table keeps absolute slots and lets go of the pages below
the window of the forward it is admitted for; its admission counts those as
available. A state group's table is sparse (`SnapshotStateGroup`); the
groups' pools are in group_pools.py. The prefix hit is the longest one
every group can serve (`match`); the host tier caches the full-history
group's pages and the state group's checkpoints for prefix hits, and
snapshots every group's.
"""

from __future__ import annotations

import itertools

from pdserve.scheduler.cache_groups import HOLE
from pdserve.scheduler.group_pools import FullHistoryGroup, GroupDemand
from pdserve.scheduler.plan import LoadOp, StoreOp
from pdserve.scheduler.pool import PagePool, PoolError
from pdserve.scheduler.prefix import ROOT_HASH, PrefixIndex, WindowIndex, chain_hash


class HostTier:
    """The L2 host cache of one group: a page pool and prefix index in host
    memory. The full-history group's index serves prefix hits by chain, a
    state group's (`keyed`) serves checkpoints by the chain hash of the
    prefix they end; every group's tier takes retraction snapshots."""

    def __init__(self, total_pages: int, keyed: bool = False):
        self.pool = PagePool(total_pages)
        self.index = WindowIndex(self.pool) if keyed else \
            PrefixIndex(self.pool, strict_holding=False)

    def allocate(self, n: int) -> list[int] | None:
        """n host pages (refcount 1), evicting idle cached ones; None if the
        tier cannot supply them all (host writes are best effort)."""
        short = n - self.pool.num_free
        if short > 0:
            got = self.index.evict(short, best_effort=True)
            for p in got:
                self.pool.put_free(p)
            if len(got) < short:
                return None
        return self.pool.take(n)

    def hold(self, pages) -> None:
        rc = self.pool.refcount
        for p in pages:
            if rc[p] == 0 and self.index.contains(p):
                self.index.claim(p)
            rc[p] += 1

    def release(self, pages) -> None:
        _drop_refs(self.pool, self.index, pages)


class Hit:
    """A prefix hit every group can serve: slots [0, pages) are cached.
    `device[g]` are group g's device pages for slots [first[g], device_end)
    (a sliding group's lookback; none for a replayable group), `host` the
    full-history group's host pages for slots [device_end, pages), and
    `state_host` the host slot of the state checkpoint at the hit's end when
    the device has none (-1: it has, or there is no state group)."""

    __slots__ = ("pages", "device_end", "device", "first", "host", "tail", "state_host")

    def __init__(self, pages: int, device: list, first: list, host: list, tail: int,
                 state_host: int = -1):
        self.pages = pages
        self.device_end = pages - len(host)
        self.device = device
        self.first = first
        self.host = host
        self.tail = tail              # chain hash of the prefix [0, device_end)
        self.state_host = state_host


class Coordinator:
    def __init__(self, groups: list[FullHistoryGroup], host_pages: int = 0,
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
        # a host tier per group (a state group's holds state slots)
        self.hosts = [HostTier(host_slots or grp.pool.total, keyed=True) if grp.spec.state
                      else HostTier(host_pages) for grp in groups] if host_pages else []
        self.host = self.hosts[0] if self.hosts else None
        self.pending_stores: list[StoreOp] = []     # made, not yet handed to a plan
        self.stores: dict[int, StoreOp] = {}        # handed out, not yet acked (and pending)
        self.loads: dict[int, LoadOp] = {}
        self.fences: dict = {}                      # key -> per group, device pages a late write may reach
        # The last refused admission: (pages it needed from the pool, pages
        # free then, evictable cached ones included), in the group that
        # refused. Read by waiting.py only.
        self.refused: tuple[int, int] = (0, 0)
        self._next_op = 0

    # ---- queries (pure) --------------------------------------------------
    def available_pages(self, g: int = 0) -> int:
        """Pages an admission could take now: free plus idle cached."""
        grp = self.groups[g]
        return grp.pool.num_free + grp.index.num_idle

    def free_pages(self) -> int:
        """Group 0's pages no request holds or pins (evictable cached count)."""
        return self.available_pages(0)

    def match(self, req, max_pages: int, sliding: bool = True, use_host: bool = True) -> Hit:
        """The longest cached prefix of at most max_pages pages that every
        group can serve: the full-history group's device chain continued on
        host, cut back until each cached sliding group holds the lookback
        its first new query reads (its last W - 1 positions) and the state
        group a checkpoint at its end (§1.2: a hit restores the nearest
        published checkpoint at or before it, on the device or, with
        `use_host`, on host). `sliding` False: only the full history is
        asked (a D landing receives the sliding windows and the state from
        the peer). Pure."""
        groups, ps, n_groups = self.groups, self.groups[0].page_size, len(self.groups)
        keys = []                         # page keys, made as far as a matcher reads

        def more():
            for i in range(max_pages):
                keys.append(req.page_key(i, ps))
                yield keys[-1]
        dev, host = [], []
        if self.full is not None:
            grp = groups[0]
            it = more()
            dev = grp.index.match(it)
            if use_host and self.host is not None and len(dev) < max_pages:
                parent = grp.index.hash_of(dev[-1]) if dev else ROOT_HASH
                host = self.host.index.match(itertools.chain(keys[len(dev):], it), parent)
            n = len(dev) + len(host)
        else:
            if self.cached_sliding and sliding:
                keys = [req.page_key(i, ps) for i in range(max_pages)]
            n = len(keys)
        first = [0] * n_groups
        device = [[] for _ in range(n_groups)]
        device[0] = dev
        todo = [g for g in self.keyed if sliding]
        hashes = []
        state_host = -1
        if todo and n:
            h = ROOT_HASH
            for key in keys[:n]:
                h = chain_hash(h, key)
                hashes.append(h)
            found = {g: [groups[g].index.find(x) for x in hashes] for g in todo}
            s = self.state
            on_host = [None] * n
            if s in found and use_host and self.hosts:
                # a checkpoint the device evicted may still be on host
                on_host = [self.hosts[s].index.find(x) for x in hashes]
                cut = dict(found)
                cut[s] = [d if d is not None else h for d, h in zip(found[s], on_host)]
                n = self._sliding_cut(cut, n)
            else:
                n = self._sliding_cut(found, n)
            for g in todo:
                first[g] = groups[g].first_live(n * ps)
                device[g] = [p for p in found[g][first[g]:n] if p is not None] \
                    if g == s else found[g][first[g]:n]
            if s in found and n and not device[s]:
                state_host = on_host[n - 1]
        elif todo:
            n = 0
        if self.full is None:
            return Hit(n, device, first, [], hashes[n - 1] if n else ROOT_HASH)
        index = groups[0].index
        if n <= len(dev):
            device[0] = dev[:n]
            return Hit(n, device, first, [], index.hash_of(dev[n - 1]) if n else ROOT_HASH,
                       state_host)
        return Hit(n, device, first, host[:n - len(dev)],
                   index.hash_of(dev[-1]) if dev else ROOT_HASH, state_host)

    def _sliding_cut(self, found: dict, n: int) -> int:
        """The largest m <= n at which every sliding group holds the pages
        of slots [first_live(m * ps), m) and the state group a checkpoint
        in slot m - 1 (which it has only where m pages end a state block)."""
        runs = {}
        for g, pages in found.items():
            run, start = [], 0
            for i, p in enumerate(pages):
                if p is None:
                    start = i + 1
                run.append(start)           # first slot of the present run ending at i
            runs[g] = run
        ps = self.groups[0].page_size

        def serves(g, m):
            grp = self.groups[g]
            if grp.spec.state:
                return found[g][m - 1] is not None and grp.aligned(m * ps)
            lo = grp.first_live(m * ps)
            return runs[g][m - 1] <= lo or lo >= m

        for m in range(n, 0, -1):
            if all(serves(g, m) for g in found):
                return m
        return 0

    def pinned_stores_outstanding(self) -> int:
        return sum(1 for s in self.stores.values() if s.pinned)

    def _op_id(self) -> int:
        self._next_op += 1
        return self._next_op

    # ---- admission -------------------------------------------------------
    def admit(self, req, res, demands: list[GroupDemand], publish_pages: int, plan,
              hit: Hit | None = None) -> bool:
        """Grant every group's demand, claim the device part of `hit`, load
        its host part, publish the pages up to `publish_pages`, let each
        sliding group's slots below its window go (a state group's below the
        state its forward reads) and record the state checkpoint the forward
        will materialize; or change nothing and return False. Slots a group
        lets go count as available to the same admission."""
        grants = []
        fresh_hit = hit is not None and not res.tables[0] and hit.pages
        for g, (grp, demand) in enumerate(zip(self.groups, demands)):
            table = res.tables[g]
            hit_pages = hit.device[g] if fresh_hit else ()
            grant = self._grant(grp, table, demand, hit_pages, hit.first[g] if hit_pages else 0)
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
                return False
        if hit is not None and hit.host and len(hit.host) > grants[0][0]:
            raise PoolError("a host hit beyond the admitted pages")
        if fresh_hit:
            self._claim(res, hit)
        # the full history grows first (a host hit's pages are published
        # with it); sliding groups publish, then let go, then grow
        for g in self._order:
            if g is None:
                if publish_pages > res.published:
                    self._publish(req, res, publish_pages, store=True)
                continue
            grp, table = self.groups[g], res.tables[g]
            need, lo, entries, mark = grants[g]
            if lo:
                self._let_go(grp, table, lo)
            if grp.spec.state:
                if need:
                    self._place(table, entries, self._allocate(grp, need))
                if fresh_hit and hit.state_host >= 0:
                    # the hit's checkpoint from host into the slot its forward reads
                    self._load(req.id, g, [hit.state_host], [table[hit.pages - 1]], plan)
                if mark is not None:
                    res.marks.add(mark)
                continue
            if not need:
                continue
            pages = self._allocate(grp, need)
            if g == 0 and hit is not None and hit.host:
                self._load(req.id, 0, list(hit.host), pages[:len(hit.host)], plan)
            table.extend(pages)
            plan.fresh_pages.extend(pages)
        tables = res.tables
        slots_held = len(tables[0]) if len(tables) == 1 else min(len(t) for t in tables)
        req.capacity = slots_held * self.page_size
        return True

    def _load(self, req_id: str, g: int, host_pages: list, device_pages: list, plan) -> None:
        """A load ticket for a host hit: it holds the host pages until done."""
        self.hosts[g].hold(host_pages)
        load = LoadOp(self._op_id(), req_id, host_pages, device_pages, group=g)
        self.loads[load.id] = load
        plan.loads.append(load)

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
            _drop_refs(grp.pool, grp.index, gone)
            for i in range(lo):
                table[i] = HOLE

    def _allocate(self, grp: FullHistoryGroup, n: int) -> list[int]:
        short = n - grp.pool.num_free
        if short > 0:
            for p in grp.index.evict(short):
                grp.pool.put_free(p)
        return grp.pool.take(n)

    # ---- publication -----------------------------------------------------
    def _publish(self, req, res, upto: int, store: bool) -> None:
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
        ps = self.groups[0].page_size
        sliding = [(self.groups[g].index, res.tables[g]) for g in self.cached_sliding]
        state = self.state is not None and res.marks
        if state:
            sindex, stable, marks = self.groups[self.state].index, res.tables[self.state], res.marks
        full = self.full is not None and res.publishing
        index = self.groups[0].index if full else None
        table = res.tables[0]
        parent, h = res.chain_tail, res.content_tail
        fresh, fresh_states = [], []
        for i in range(res.published, upto):
            key = req.page_key(i, ps)
            if self.keyed:
                h = chain_hash(h, key)
                for windex, wtable in sliding:
                    if i < len(wtable) and wtable[i] != HOLE and not windex.contains(wtable[i]):
                        windex.insert(h, wtable[i])
                if state and i in marks:
                    marks.discard(i)
                    slot = stable[i] if i < len(stable) else HOLE
                    if slot != HOLE and not sindex.contains(slot) and sindex.insert(h, slot):
                        fresh_states.append((slot, h))
            if full:
                page = table[i]
                hf = index.insert(parent, key, page)
                if hf is None:
                    twin = index.find(parent, key)
                    if twin is None or res.forwards_out:
                        full = res.publishing = False
                        continue
                    # another request cached this content first: hold its page
                    # instead of ours, so the chain goes on under it
                    self._adopt(table, i, twin)
                    parent = index.hash_of(twin)
                    continue
                fresh.append((page, parent, key, hf))
                parent = hf
        res.chain_tail = parent
        res.content_tail = h
        res.published = upto
        if store and fresh and self.host is not None:
            self._store_published(req.id, fresh, table)
        if store and fresh_states and self.hosts:
            self._store_states(req.id, fresh_states)

    def _adopt(self, table: list, i: int, twin: int) -> None:
        """Slot i of the full-history table takes the cached page `twin`,
        which holds the same content; the request's own copy goes back (no
        forward of the request is out to read it)."""
        grp = self.groups[0]
        rc = grp.pool.refcount
        if rc[twin] == 0:
            grp.index.claim(twin)
        rc[twin] += 1
        own, table[i] = table[i], twin
        _drop_refs(grp.pool, grp.index, [own])

    def _store_published(self, req_id: str, fresh, table) -> None:
        host = self.host
        todo = [f for f in fresh if not host.index.has_hash(f[3])]
        if not todo:
            return
        host_pages = host.allocate(len(todo))
        if host_pages is None:
            return                      # best effort: the device copy stays cached
        rc = self.groups[0].pool.refcount
        pins = table[:table.index(todo[-1][0]) + 1]
        for page in pins:
            rc[page] += 1               # pinned until the ack
        op = StoreOp(self._op_id(), req_id, [f[0] for f in todo], host_pages, True,
                     [(f[1], f[2]) for f in todo], pins)
        self.stores[op.id] = op
        self.pending_stores.append(op)

    def _store_states(self, req_id: str, fresh: list) -> None:
        """Pinned stores of newly published state checkpoints to the state
        group's host tier (best effort), each source slot held until the ack."""
        g = self.state
        host = self.hosts[g]
        todo = [(slot, h) for slot, h in fresh if host.index.find(h) is None]
        host_slots = host.allocate(len(todo)) if todo else None
        if not host_slots:
            return
        rc = self.groups[g].pool.refcount
        for slot, _ in todo:
            rc[slot] += 1
        op = StoreOp(self._op_id(), req_id, [s for s, _ in todo], host_slots, True,
                     [h for _, h in todo], [s for s, _ in todo], group=g)
        self.stores[op.id] = op
        self.pending_stores.append(op)

    def publish(self, req, res, upto: int, store: bool = True) -> None:
        if upto > res.published:
            self._publish(req, res, upto, store)

    def take_pending_stores(self) -> list[StoreOp]:
        out, self.pending_stores = self.pending_stores, []
        return out

    # ---- the host snapshot of a retraction --------------------------------
    def snapshot(self, req_id: str, res, pages: int, plan) -> list | None:
        """Stream-ordered copies of the device pages of slots [0, pages) of
        every group but the replayable ones (of a state group, the state
        after those pages' tokens), to fresh host pages the
        caller's Retracted state will hold: per group, a host page or HOLE
        per slot. None if the host tiers cannot take them all."""
        if self.host is None or pages == 0:
            return None
        snap, ops = [], []
        for g, grp in enumerate(self.groups):
            slots = res.tables[g][:pages]
            if grp.spec.state:
                # the working state only: the checkpoints are cached or recomputed
                r = grp.first_live(pages * self.page_size)
                slots = [HOLE] * r + res.tables[g][r:r + 1]
            src = [p for p in slots if p != HOLE] if not grp.spec.replayable else []
            host_pages = self.hosts[g].allocate(len(src)) if src else []
            if host_pages is None:
                for g2, s in enumerate(snap):
                    self.hosts[g2].release([p for p in s if p != HOLE])
                return None
            it = iter(host_pages)
            snap.append([next(it) if p != HOLE else HOLE for p in slots] if src else [])
            if src:
                ops.append(StoreOp(self._op_id(), req_id, src, host_pages, False, group=g))
        for op in ops:
            self.stores[op.id] = op
            plan.stores.append(op)
        return snap

    def load_snapshot(self, req_id: str, res, snap: list, start: int, plan) -> None:
        """Readmission: load each group's snapshot pages of the slots the
        (just admitted) table holds from `start` on; host copies of slots a
        device hit or a slid-out window made moot are let go. The
        snapshot's hold on what loads passes to the load ticket."""
        for g, host_pages in enumerate(snap):
            if not host_pages:
                continue
            table = res.tables[g]
            load_h, load_d, drop = [], [], []
            for i, hp in enumerate(host_pages):
                if hp == HOLE:
                    continue
                if i >= start and i < len(table) and table[i] != HOLE:
                    load_h.append(hp)
                    load_d.append(table[i])
                else:
                    drop.append(hp)
            self.hosts[g].release(drop)
            if load_h:
                op = LoadOp(self._op_id(), req_id, load_h, load_d, group=g)
                self.loads[op.id] = op
                plan.loads.append(op)

    def release_snapshot(self, snap: list) -> None:
        for g, host_pages in enumerate(snap):
            self.hosts[g].release([p for p in host_pages if p != HOLE])

    # ---- acks ------------------------------------------------------------
    def store_done(self, op_id: int) -> None:
        op = self.stores.pop(op_id)
        if not op.pinned:
            return                      # the snapshot's host pages stay with its owner
        host = self.hosts[op.group]
        if op.group == self.state:
            for hp, h in zip(op.host_pages, op.entries):
                host.index.insert(h, hp)             # dropped if h was cached meanwhile
        else:
            for hp, (parent, key) in zip(op.host_pages, op.entries):
                host.index.insert(parent, key, hp)   # dropped if its parent left the host index
        host.release(op.host_pages)
        self._unref(reversed(op.pins), op.group)

    def store_failed(self, op_id: int) -> None:
        """A store that did not happen: its host pages hold nothing, so they
        go back unpublished; a pinned store's sources are unpinned."""
        op = self.stores.pop(op_id)
        if op.pinned:
            self.hosts[op.group].release(op.host_pages)
            self._unref(reversed(op.pins), op.group)

    def load_done(self, op_id: int) -> None:
        op = self.loads.pop(op_id)
        self.hosts[op.group].release(op.host_pages)

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
            _drop_refs(grp.pool, grp.index, reversed(pages))

    def fenced_pages(self) -> int:
        return sum(len(pages[0]) for pages in self.fences.values())

    # ---- release ---------------------------------------------------------
    def _unref(self, pages, g: int = 0) -> None:
        _drop_refs(self.groups[g].pool, self.groups[g].index, pages)

    def release(self, res) -> None:
        """Drop the request's hold on every page, deepest first, so that the
        deepest pages carry the oldest LRU stamps."""
        for grp, table in zip(self.groups, res.tables):
            _drop_refs(grp.pool, grp.index, [p for p in reversed(table) if p != HOLE])
            table.clear()
        res.marks.clear()

    # ---- invariants ------------------------------------------------------
    def check_invariants(self, live_tables: list, snapshots: list | None = None) -> None:
        """free + cached + held == total in every pool, and every refcount
        equals the references its owners (tables, tickets, snapshots) hold."""
        for g, grp in enumerate(self.groups):
            expected = [0] * grp.pool.total
            for tables in live_tables:
                for p in tables[g]:
                    if p != HOLE:
                        expected[p] += 1
            for op in self.stores.values():
                if op.pinned and op.group == g:
                    for p in op.pins:
                        expected[p] += 1
            for pages in self.fences.values():
                for p in pages[g]:
                    expected[p] += 1
            _check_pool(f"group {g}", grp.pool, grp.index, expected)
        for g, host in enumerate(self.hosts):
            expected = [0] * host.pool.total
            for snap in snapshots or ():
                for p in (snap[g] if snap else ()):
                    if p != HOLE:
                        expected[p] += 1
            for op in self.stores.values():
                if op.pinned and op.group == g:
                    for p in op.host_pages:
                        expected[p] += 1
            for op in self.loads.values():
                if op.group == g:
                    for p in op.host_pages:
                        expected[p] += 1
            _check_pool(f"host group {g}", host.pool, host.index, expected)


def _drop_refs(pool: PagePool, index, pages) -> None:
    """One reference fewer on each page: a page nobody holds any more
    becomes idle in the index if it is cached, else free."""
    rc = pool.refcount
    for p in pages:
        rc[p] -= 1
        if rc[p] == 0:
            if index.contains(p):
                index.idle(p)
            else:
                pool.put_free(p)
        elif rc[p] < 0:
            raise PoolError(f"page {p} released more often than held")


def _check_pool(name: str, pool: PagePool, index, expected: list[int]) -> None:
    pool.check_invariants()
    index.check_invariants()
    if expected != pool.refcount:
        bad = next(p for p in range(pool.total) if expected[p] != pool.refcount[p])
        raise PoolError(f"{name} page {bad}: refcount {pool.refcount[bad]}, "
                        f"its owners hold {expected[bad]}")
    held = sum(1 for c in pool.refcount if c)
    if pool.num_free + index.num_idle + held != pool.total:
        raise PoolError(f"{name}: free {pool.num_free} + cached {index.num_idle} + "
                        f"held {held} != total {pool.total}")
