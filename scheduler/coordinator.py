"""The cache coordinator: admission of pages for every cache group at once.

`admit` is all or nothing. It takes one `GroupDemand` per group (the tokens
the chunk reaches plus the reserve behind it) and the request's publication
progress; it either grants every group's pages, claims the prefix hit and
publishes the pages completed since the last admission, or changes nothing
and returns None (spec §2, "resources and publication progress land when an
admission succeeds").

Only full-history groups exist today; the list shape is the extension point
for sliding-window and state groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.scheduler.pool import PagePool, PoolError
from pdserve.scheduler.prefix import ROOT, PrefixIndex


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


class Coordinator:
    def __init__(self, groups: list[FullHistoryGroup]):
        if not groups:
            raise ValueError("a coordinator needs at least one cache group")
        self.groups = groups

    # ---- queries (pure) --------------------------------------------------
    def available_pages(self, g: int = 0) -> int:
        """Pages an admission could take now: free plus idle cached."""
        grp = self.groups[g]
        return grp.pool.num_free + grp.index.num_idle

    def free_pages(self) -> int:
        """Pages no request holds or pins (evictable cached pages count)."""
        return self.available_pages(0)

    def match(self, req, max_pages: int) -> list[int]:
        """Group 0's cached prefix for this request, at most max_pages long."""
        grp = self.groups[0]
        ps = grp.page_size
        return grp.index.match(req.page_key(i, ps) for i in range(max_pages))

    # ---- admission -------------------------------------------------------
    def admit(self, req, res, demands: list[GroupDemand], publish_pages: int,
              hit: list[int] | None = None, fresh: list[int] | None = None) -> bool:
        """Grant every group's demand, claim `hit`, publish group 0's pages
        up to `publish_pages`; or change nothing and return False."""
        grp0 = self.groups[0]
        rc0 = grp0.pool.refcount
        claimed_idle = 0
        if hit:
            claimed_idle = sum(1 for p in hit if rc0[p] == 0)
        needs = []
        for g, (grp, demand) in enumerate(zip(self.groups, demands)):
            held = len(res.tables[g]) + (len(hit) if (hit and g == 0) else 0)
            need = grp.pages_for(demand.tokens + demand.reserve_tokens) - held
            need = max(need, 0)
            avail = grp.pool.num_free + grp.index.num_idle - (claimed_idle if g == 0 else 0)
            if need > avail:
                return False
            needs.append(need)
        if hit:
            table = res.tables[0]
            index = grp0.index
            for p in hit:
                if rc0[p] == 0:
                    index.claim(p)
                rc0[p] += 1
                table.append(p)
            res.published = len(hit)
            res.chain_tail = hit[-1]
        for grp, need, table in zip(self.groups, needs, res.tables):
            if need:
                pages = self._allocate(grp, need)
                table.extend(pages)
                if fresh is not None:
                    fresh.extend(pages)
        req.capacity = len(res.tables[0]) * grp0.page_size
        if publish_pages > res.published:
            self._publish(req, res, publish_pages)
        return True

    def _allocate(self, grp: FullHistoryGroup, n: int) -> list[int]:
        short = n - grp.pool.num_free
        if short > 0:
            for p in grp.index.evict(short):
                grp.pool.put_free(p)
        return grp.pool.take(n)

    def _publish(self, req, res, upto: int) -> None:
        """Put group 0's pages [published, upto) into the prefix index, in
        chain order. A key another page already owns ends this request's
        chain: its later pages stay private (see prefix.py for why)."""
        grp = self.groups[0]
        if not res.publishing:
            res.published = upto
            return
        index, table, ps = grp.index, res.tables[0], grp.page_size
        parent = res.chain_tail
        for i in range(res.published, upto):
            page = table[i]
            if not index.insert(parent, req.page_key(i, ps), page):
                res.publishing = False
                break
            parent = page
        res.chain_tail = parent
        res.published = upto

    def publish(self, req, res, upto: int) -> None:
        if upto > res.published:
            self._publish(req, res, upto)

    # ---- release ---------------------------------------------------------
    def release(self, res) -> None:
        """Drop the request's hold on every page, deepest first, so that the
        deepest pages carry the oldest LRU stamps."""
        for grp, table in zip(self.groups, res.tables):
            rc, index, pool = grp.pool.refcount, grp.index, grp.pool
            for p in reversed(table):
                rc[p] -= 1
                if rc[p] == 0:
                    if index.contains(p):
                        index.idle(p)
                    else:
                        pool.put_free(p)
                elif rc[p] < 0:
                    raise PoolError(f"page {p} released more often than held")
            table.clear()

    # ---- invariants ------------------------------------------------------
    def check_invariants(self, live_tables: list[list[list[int]]]) -> None:
        """free + cached + held == total per group, and every refcount equals
        the number of live tables that hold the page."""
        for g, grp in enumerate(self.groups):
            grp.pool.check_invariants()
            grp.index.check_invariants()
            expected = [0] * grp.pool.total
            for tables in live_tables:
                for p in tables[g]:
                    expected[p] += 1
            if expected != grp.pool.refcount:
                bad = next(p for p in range(grp.pool.total) if expected[p] != grp.pool.refcount[p])
                raise PoolError(
                    f"group {g} page {bad}: refcount {grp.pool.refcount[bad]}, "
                    f"held by {expected[bad]} tables")
            held = sum(1 for c in grp.pool.refcount if c)
            idle = grp.index.num_idle
            if grp.pool.num_free + idle + held != grp.pool.total:
                raise PoolError(
                    f"group {g}: free {grp.pool.num_free} + cached {idle} + held {held} "
                    f"!= total {grp.pool.total}")
