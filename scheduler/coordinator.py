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

Only full-history groups exist today; the list shape is the extension point
for sliding-window and state groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.scheduler.plan import LoadOp, StoreOp
from pdserve.scheduler.pool import PagePool, PoolError
from pdserve.scheduler.prefix import ROOT_HASH, PrefixIndex


@dataclass(frozen=True)
class GroupDemand:
    tokens: int          # the chunk's end position: pages must hold [0, tokens)
    reserve_tokens: int  # held beyond the chunk (decode slot, headroom: §1)


class FullHistoryGroup:
    """Keeps every page of a request's history; prefix-cached by page."""

    retention = "full_history"

    def __init__(self, total_pages: int, page_size: int):
        self.page_size = page_size
        self.pool = PagePool(total_pages)
        self.index = PrefixIndex(self.pool)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


class HostTier:
    """The L2 host cache: a page pool and prefix index in host memory."""

    def __init__(self, total_pages: int):
        self.pool = PagePool(total_pages)
        self.index = PrefixIndex(self.pool, strict_holding=False)

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


class Coordinator:
    def __init__(self, groups: list[FullHistoryGroup], host_pages: int = 0):
        if not groups:
            raise ValueError("a coordinator needs at least one cache group")
        self.groups = groups
        self.host = HostTier(host_pages) if host_pages else None
        self.pending_stores: list[StoreOp] = []     # made, not yet handed to a plan
        self.stores: dict[int, StoreOp] = {}        # handed out, not yet acked (and pending)
        self.loads: dict[int, LoadOp] = {}
        self.fences: dict = {}                      # key -> device pages a late write may reach
        # The last refused admission: (pages it needed from the pool, pages
        # free then, evictable cached ones included). Read by waiting.py only.
        self.refused: tuple[int, int] = (0, 0)
        self._next_op = 0

    # ---- queries (pure) --------------------------------------------------
    def available_pages(self, g: int = 0) -> int:
        """Pages an admission could take now: free plus idle cached."""
        grp = self.groups[g]
        return grp.pool.num_free + grp.index.num_idle

    def free_pages(self) -> int:
        """Pages no request holds or pins (evictable cached pages count)."""
        return self.available_pages(0)

    def match(self, req, max_pages: int) -> tuple[list[int], list[int]]:
        """Group 0's cached prefix for this request, at most max_pages long:
        device pages, then the host pages that continue the chain."""
        grp = self.groups[0]
        ps = grp.page_size
        dev = grp.index.match(req.page_key(i, ps) for i in range(max_pages))
        if self.host is None or len(dev) == max_pages:
            return dev, []
        parent = grp.index.hash_of(dev[-1]) if dev else ROOT_HASH
        host = self.host.index.match(
            (req.page_key(i, ps) for i in range(len(dev), max_pages)), parent)
        return dev, host

    def pinned_stores_outstanding(self) -> int:
        return sum(1 for s in self.stores.values() if s.pinned)

    def _op_id(self) -> int:
        self._next_op += 1
        return self._next_op

    # ---- admission -------------------------------------------------------
    def admit(self, req, res, demands: list[GroupDemand], publish_pages: int, plan,
              hit: list[int] | None = None, host_hit: list[int] | None = None) -> bool:
        """Grant every group's demand, claim the device `hit`, load the
        `host_hit` that follows it, publish group 0's pages up to
        `publish_pages`; or change nothing and return False."""
        grp0 = self.groups[0]
        rc0 = grp0.pool.refcount
        nhit = len(hit) if hit else 0
        claimed_idle = sum(1 for p in hit if rc0[p] == 0) if hit else 0
        needs = []
        for g, (grp, demand) in enumerate(zip(self.groups, demands)):
            held = len(res.tables[g]) + (nhit if g == 0 else 0)
            need = max(grp.pages_for(demand.tokens + demand.reserve_tokens) - held, 0)
            avail = grp.pool.num_free + grp.index.num_idle - (claimed_idle if g == 0 else 0)
            if need > avail:
                # its own idle hit pages count once on each side, as free_pages() shows them
                own = claimed_idle if g == 0 else 0
                self.refused = (need + own, avail + own)
                return False
            needs.append(need)
        if host_hit and len(host_hit) > needs[0]:
            raise PoolError("a host hit beyond the admitted pages")
        if hit:
            table = res.tables[0]
            index = grp0.index
            for p in hit:
                if rc0[p] == 0:
                    index.claim(p)
                rc0[p] += 1
                table.append(p)
            res.published = nhit
            res.chain_tail = index.hash_of(hit[-1])
        for g, (grp, need, table) in enumerate(zip(self.groups, needs, res.tables)):
            if need:
                pages = self._allocate(grp, need)
                if g == 0 and host_hit:
                    self.host.hold(host_hit)
                    load = LoadOp(self._op_id(), req.id, list(host_hit), pages[:len(host_hit)])
                    self.loads[load.id] = load
                    plan.loads.append(load)
                table.extend(pages)
                plan.fresh_pages.extend(pages)
        req.capacity = len(res.tables[0]) * grp0.page_size
        if publish_pages > res.published:
            self._publish(req, res, publish_pages, store=True)
        return True

    def _allocate(self, grp: FullHistoryGroup, n: int) -> list[int]:
        short = n - grp.pool.num_free
        if short > 0:
            for p in grp.index.evict(short):
                grp.pool.put_free(p)
        return grp.pool.take(n)

    # ---- publication -----------------------------------------------------
    def _publish(self, req, res, upto: int, store: bool) -> None:
        """Put group 0's pages [published, upto) into the prefix index, in
        chain order, and (with a host tier, when `store`) queue pinned
        stores that copy them to host. A key another page already owns ends
        this request's chain: its later pages stay private (prefix.py)."""
        if not res.publishing:
            res.published = upto
            return
        grp = self.groups[0]
        index, table, ps = grp.index, res.tables[0], grp.page_size
        parent = res.chain_tail
        fresh = []
        for i in range(res.published, upto):
            page = table[i]
            key = req.page_key(i, ps)
            h = index.insert(parent, key, page)
            if h is None:
                res.publishing = False
                break
            fresh.append((page, parent, key, h))
            parent = h
        res.chain_tail = parent
        res.published = upto
        if store and fresh and self.host is not None:
            self._store_published(req.id, fresh, table)

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

    def publish(self, req, res, upto: int, store: bool = True) -> None:
        if upto > res.published:
            self._publish(req, res, upto, store)

    def take_pending_stores(self) -> list[StoreOp]:
        out, self.pending_stores = self.pending_stores, []
        return out

    # ---- the host snapshot of a retraction --------------------------------
    def snapshot(self, req_id: str, res, pages: int, plan) -> list[int] | None:
        """A stream-ordered copy of the first `pages` device pages to fresh
        host pages the caller's Retracted state will hold; None if the host
        tier cannot take them."""
        if self.host is None or pages == 0:
            return None
        host_pages = self.host.allocate(pages)
        if host_pages is None:
            return None
        op = StoreOp(self._op_id(), req_id, list(res.tables[0][:pages]), host_pages, False)
        self.stores[op.id] = op
        plan.stores.append(op)
        return host_pages

    def load_snapshot(self, req_id: str, res, host_pages: list[int], start: int, plan) -> None:
        """Readmission: load snapshot pages [start, ...) into the same pages
        of the (just admitted) table; the first `start` came back as a
        device prefix hit, so their host copies are let go. The snapshot's
        hold on the rest passes to the load ticket."""
        if start >= len(host_pages):
            if host_pages:
                self.host.release(host_pages)
            return
        self.host.release(host_pages[:start])
        op = LoadOp(self._op_id(), req_id, host_pages[start:],
                    res.tables[0][start:len(host_pages)])
        self.loads[op.id] = op
        plan.loads.append(op)

    def release_snapshot(self, host_pages: list[int]) -> None:
        self.host.release(host_pages)

    # ---- acks ------------------------------------------------------------
    def store_done(self, op_id: int) -> None:
        op = self.stores.pop(op_id)
        if not op.pinned:
            return                      # the snapshot's host pages stay with its owner
        host = self.host
        for hp, (parent, key) in zip(op.host_pages, op.entries):
            host.index.insert(parent, key, hp)   # dropped if its parent left the host index
        host.release(op.host_pages)
        self._unref(reversed(op.pins))

    def store_failed(self, op_id: int) -> None:
        """A store that did not happen: its host pages hold nothing, so they
        go back unpublished; a pinned store's sources are unpinned."""
        op = self.stores.pop(op_id)
        if op.pinned:
            self.host.release(op.host_pages)
            self._unref(reversed(op.pins))

    def load_done(self, op_id: int) -> None:
        op = self.loads.pop(op_id)
        self.host.release(op.host_pages)

    # ---- fences ------------------------------------------------------------
    def fence(self, key, res) -> None:
        """Keep a bundle's pages held under `key` instead of releasing them:
        a posted write may still land in them (transfer/landing.py)."""
        if key in self.fences:
            raise PoolError(f"fence {key!r} exists")
        self.fences[key] = list(res.tables[0])
        res.tables[0].clear()

    def release_fence(self, key) -> None:
        self._unref(reversed(self.fences.pop(key)))

    # ---- release ---------------------------------------------------------
    def _unref(self, pages) -> None:
        _drop_refs(self.groups[0].pool, self.groups[0].index, pages)

    def release(self, res) -> None:
        """Drop the request's hold on every page, deepest first, so that the
        deepest pages carry the oldest LRU stamps."""
        for grp, table in zip(self.groups, res.tables):
            _drop_refs(grp.pool, grp.index, reversed(table))
            table.clear()

    # ---- invariants ------------------------------------------------------
    def check_invariants(self, live_tables: list, snapshots: list | None = None) -> None:
        """free + cached + held == total in every pool, and every refcount
        equals the references its owners (tables, tickets, snapshots) hold."""
        for g, grp in enumerate(self.groups):
            expected = [0] * grp.pool.total
            for tables in live_tables:
                for p in tables[g]:
                    expected[p] += 1
            if g == 0:
                for op in self.stores.values():
                    if op.pinned:
                        for p in op.pins:
                            expected[p] += 1
                for pages in self.fences.values():
                    for p in pages:
                        expected[p] += 1
            _check_pool(f"group {g}", grp.pool, grp.index, expected)
        if self.host is not None:
            expected = [0] * self.host.pool.total
            for pages in snapshots or ():
                for p in pages:
                    expected[p] += 1
            for op in self.stores.values():
                if op.pinned:
                    for p in op.host_pages:
                        expected[p] += 1
            for op in self.loads.values():
                for p in op.host_pages:
                    expected[p] += 1
            _check_pool("host", self.host.pool, self.host.index, expected)


def _drop_refs(pool: PagePool, index: PrefixIndex, pages) -> None:
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


def _check_pool(name: str, pool: PagePool, index: PrefixIndex, expected: list[int]) -> None:
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
