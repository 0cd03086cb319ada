"""The prefix index: full pages keyed by a hash chain, evicted LRU, leaves only.

A node is (parent page, content key) -> page; the chain from the root to a
node names a whole prefix, compared exactly (no hash collisions). Only a
page whose refcount is 0 and which has no cached child is a candidate for
eviction, so a cached prefix is always reachable from the root. Probing a
match does not touch LRU order; a page is stamped when its last holder lets
go of it.

Why every idle cached page is reachable by leaf-first eviction: a request
that holds a cached page holds its whole chain (it matched or published the
chain in order), and a request publishes a child only under a node it
holds. So a cached page with refcount 0 has only idle cached descendants.
"""

from __future__ import annotations

import heapq

from pdserve.scheduler.pool import PagePool, PoolError

ROOT = -1


class PrefixIndex:
    __slots__ = ("_pool", "_by_key", "_key_of", "_children", "_stamp", "_heap",
                 "_clock", "num_idle")

    def __init__(self, pool: PagePool):
        self._pool = pool
        self._by_key: dict = {}                      # (parent, key) -> page
        self._key_of: list = [None] * pool.total     # page -> (parent, key)
        self._children = [0] * pool.total            # cached children per page
        self._stamp = [0] * pool.total
        self._heap: list = []                        # (stamp, page): maybe-evictable leaves
        self._clock = 0
        self.num_idle = 0                            # cached pages with refcount 0

    @property
    def num_cached(self) -> int:
        return len(self._by_key)

    def contains(self, page: int) -> bool:
        return self._key_of[page] is not None

    def lookup(self, parent: int, key) -> int | None:
        return self._by_key.get((parent, key))

    def match(self, keys) -> list[int]:
        """Pages of the longest cached chain for `keys` (an iterable of page
        keys from the root). Pure: no refcount, no LRU stamp changes."""
        pages, parent, by_key = [], ROOT, self._by_key
        for key in keys:
            page = by_key.get((parent, key))
            if page is None:
                break
            pages.append(page)
            parent = page
        return pages

    def insert(self, parent: int, key, page: int) -> bool:
        """Publish a held page under `parent`. False if that content is
        already cached under another page (the caller keeps its page private)."""
        node = (parent, key)
        if node in self._by_key:
            return False
        if self._key_of[page] is not None:
            raise PoolError(f"page {page} published twice")
        self._by_key[node] = page
        self._key_of[page] = node
        if parent != ROOT:
            self._children[parent] += 1
        return True

    def claim(self, page: int) -> None:
        """An idle cached page gets its first holder again."""
        self.num_idle -= 1

    def idle(self, page: int) -> None:
        """A cached page's last holder let go: stamp it; a leaf becomes evictable."""
        self.num_idle += 1
        self._clock += 1
        self._stamp[page] = self._clock
        if self._children[page] == 0:
            heapq.heappush(self._heap, (self._clock, page))
            if len(self._heap) > 2 * len(self._stamp) + 64:
                self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries so the heap stays O(pool) in size."""
        rc, stamp, children, key_of = self._pool.refcount, self._stamp, self._children, self._key_of
        self._heap = [(s, p) for s, p in self._heap
                      if key_of[p] is not None and not rc[p] and stamp[p] == s and not children[p]]
        heapq.heapify(self._heap)

    def evict(self, n: int) -> list[int]:
        """Remove the n least recently used idle leaves (parents become
        leaves as their children go) and return their pages, uncached."""
        out, heap, rc = [], self._heap, self._pool.refcount
        while len(out) < n:
            if not heap:
                raise PoolError(f"evict({n}): only {len(out)} evictable")
            stamp, page = heapq.heappop(heap)
            node = self._key_of[page]
            # lazy deletion: skip entries made stale by a claim, a re-stamp or a child
            if node is None or rc[page] or self._stamp[page] != stamp or self._children[page]:
                continue
            del self._by_key[node]
            self._key_of[page] = None
            self.num_idle -= 1
            parent = node[0]
            if parent != ROOT:
                self._children[parent] -= 1
                if self._children[parent] == 0 and rc[parent] == 0:
                    heapq.heappush(heap, (self._stamp[parent], parent))
            out.append(page)
        return out

    def check_invariants(self) -> None:
        rc = self._pool.refcount
        children = [0] * self._pool.total
        idle = 0
        for (parent, _key), page in self._by_key.items():
            if self._key_of[page] != (parent, _key):
                raise PoolError(f"page {page}: index entry and reverse map disagree")
            if self._pool.is_free(page):
                raise PoolError(f"cached page {page} is on the free list")
            if parent != ROOT:
                if self._key_of[parent] is None:
                    raise PoolError(f"page {page} cached under uncached parent {parent}")
                children[parent] += 1
                if rc[page] and not rc[parent]:
                    raise PoolError(f"held page {page} under idle parent {parent}")
            if rc[page] == 0:
                idle += 1
        if children != self._children:
            raise PoolError("child counts drifted")
        if idle != self.num_idle:
            raise PoolError(f"num_idle={self.num_idle}, counted {idle}")
        live = {p for s, p in self._heap if self._stamp[p] == s}
        for (_parent, _key), page in self._by_key.items():
            if rc[page] == 0 and self._children[page] == 0 and page not in live:
                raise PoolError(f"idle leaf {page} is not reachable for eviction")
