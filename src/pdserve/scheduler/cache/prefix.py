"""The prefix index: full pages keyed by a hash chain, evicted LRU, leaves only.

A node is named by its chain hash, hash((parent's chain hash, content key)),
and remembers the exact (parent hash, key) it was made from, so a lookup
compares content exactly and the same chain names the same prefix in every
tier (device and host). Only a page whose refcount is 0 and which has no
cached child is a candidate for eviction, so a cached prefix is always
reachable from the root. Probing a match does not touch LRU order; a page
is stamped when its last holder lets go of it.

On the device tier every idle cached page is reachable by leaf-first
eviction: a request that holds a cached page holds its whole chain (it
matched or published the chain in order), and a request publishes a child
only under a node it holds. So a cached page with refcount 0 has only idle
cached descendants (`strict_holding`). The host tier pins runs that need not
start at the root (a load after a device hit), so there eviction is best
effort.
"""

from __future__ import annotations

import heapq

from pdserve.scheduler.cache.pool import PagePool, PoolError

ROOT_HASH = 0x5EED


def chain_hash(parent_hash: int, key) -> int:
    return hash((parent_hash, key))


class PrefixIndex:
    __slots__ = ("_pool", "_by_hash", "_node", "_parent", "_children", "_stamp", "_heap",
                 "_clock", "num_idle", "strict_holding")

    def __init__(self, pool: PagePool, strict_holding: bool = True):
        self._pool = pool
        self._by_hash: dict[int, int] = {}           # chain hash -> page
        self._node: list = [None] * pool.total       # page -> (parent hash, key, hash)
        self._parent = [-1] * pool.total             # page -> parent page (-1: root)
        self._children = [0] * pool.total            # cached children per page
        self._stamp = [0] * pool.total
        self._heap: list = []                        # (stamp, page): maybe-evictable leaves
        self._clock = 0
        self.num_idle = 0                            # cached pages with refcount 0
        self.strict_holding = strict_holding

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def contains(self, page: int) -> bool:
        return self._node[page] is not None

    def has_hash(self, h: int) -> bool:
        return h == ROOT_HASH or h in self._by_hash

    def hash_of(self, page: int) -> int:
        return self._node[page][2]

    def find(self, parent_hash: int, key) -> int | None:
        page = self._by_hash.get(chain_hash(parent_hash, key))
        if page is None:
            return None
        node = self._node[page]
        return page if node[0] == parent_hash and node[1] == key else None

    def match(self, keys, parent_hash: int = ROOT_HASH) -> list[int]:
        """Pages of the longest cached chain for `keys` (page keys following
        `parent_hash`). Pure: no refcount, no LRU stamp changes."""
        pages, by_hash, nodes = [], self._by_hash, self._node
        for key in keys:
            h = chain_hash(parent_hash, key)
            page = by_hash.get(h)
            if page is None:
                break
            node = nodes[page]
            if node[0] != parent_hash or node[1] != key:
                break
            pages.append(page)
            parent_hash = h
        return pages

    def insert(self, parent_hash: int, key, page: int) -> int | None:
        """Publish a held page under the node `parent_hash` (which must be
        cached, or the root). Returns the new node's hash, or None if that
        content is already cached or its parent is not."""
        if parent_hash != ROOT_HASH and parent_hash not in self._by_hash:
            return None
        h = chain_hash(parent_hash, key)
        if h in self._by_hash:
            return None
        if self._node[page] is not None:
            raise PoolError(f"page {page} published twice")
        self._by_hash[h] = page
        self._node[page] = (parent_hash, key, h)
        parent = self._by_hash[parent_hash] if parent_hash != ROOT_HASH else -1
        self._parent[page] = parent
        if parent >= 0:
            self._children[parent] += 1
        return h

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

    def _evictable(self, stamp: int, page: int) -> bool:
        return (self._node[page] is not None and not self._pool.refcount[page]
                and self._stamp[page] == stamp and not self._children[page])

    def _compact(self) -> None:
        """Drop stale heap entries so the heap stays O(pool) in size."""
        self._heap = [(s, p) for s, p in self._heap if self._evictable(s, p)]
        heapq.heapify(self._heap)

    def evict(self, n: int, best_effort: bool = False) -> list[int]:
        """Remove up to n least recently used idle leaves (parents become
        leaves as their children go) and return their pages, uncached."""
        out: list[int] = []
        heap = self._heap
        while len(out) < n:
            if not heap:
                if best_effort:
                    break
                raise PoolError(f"evict({n}): only {len(out)} evictable")
            stamp, page = heapq.heappop(heap)
            if not self._evictable(stamp, page):
                continue                       # stale: claimed, re-stamped or has a child
            node = self._node[page]
            del self._by_hash[node[2]]
            self._node[page] = None
            self.num_idle -= 1
            parent = self._parent[page]
            self._parent[page] = -1
            if parent >= 0:
                self._children[parent] -= 1
                if self._children[parent] == 0 and self._pool.refcount[parent] == 0:
                    heapq.heappush(heap, (self._stamp[parent], parent))
            out.append(page)
        return out

    def check_invariants(self) -> None:
        rc = self._pool.refcount
        children = [0] * self._pool.total
        idle = 0
        for h, page in self._by_hash.items():
            node = self._node[page]
            if node is None or node[2] != h:
                raise PoolError(f"page {page}: index entry and node disagree")
            if self._pool.is_free(page):
                raise PoolError(f"cached page {page} is on the free list")
            parent = self._parent[page]
            if parent >= 0:
                if self._node[parent] is None or self._node[parent][2] != node[0]:
                    raise PoolError(f"page {page} cached under uncached parent {parent}")
                children[parent] += 1
                if self.strict_holding and rc[page] and not rc[parent]:
                    raise PoolError(f"held page {page} under idle parent {parent}")
            elif node[0] != ROOT_HASH:
                raise PoolError(f"page {page} has no parent page but a parent hash")
            if rc[page] == 0:
                idle += 1
        if children != self._children:
            raise PoolError("child counts drifted")
        if idle != self.num_idle:
            raise PoolError(f"num_idle={self.num_idle}, counted {idle}")
        live = {p for s, p in self._heap if self._stamp[p] == s}
        for page in self._by_hash.values():
            if rc[page] == 0 and self._children[page] == 0 and page not in live:
                raise PoolError(f"idle leaf {page} is not reachable for eviction")


class WindowIndex:
    """A sliding-window group's cached pages, each named by the chain hash
    of the prefix it ends (the full-history chain's hash for the same page).

    A sliding page is useful to a hit on its own: it serves a hit at P only
    together with the other pages of P's lookback, which the matcher checks
    page by page. So there is no tree here, and eviction need not be
    leaf-first (a page that slid out of a live request's window has held
    children and must still be reclaimable): it takes the least recently
    idled page. Same interface as PrefixIndex where the coordinator uses
    both: contains, claim, idle, evict, num_idle, check_invariants."""

    __slots__ = ("_pool", "_by_hash", "_hash", "_stamp", "_heap", "_clock", "num_idle")

    def __init__(self, pool: PagePool):
        self._pool = pool
        self._by_hash: dict[int, int] = {}
        self._hash: list = [None] * pool.total       # page -> chain hash
        self._stamp = [0] * pool.total
        self._heap: list = []
        self._clock = 0
        self.num_idle = 0

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def contains(self, page: int) -> bool:
        return self._hash[page] is not None

    def find(self, h: int) -> int | None:
        return self._by_hash.get(h)

    def insert(self, h: int, page: int) -> bool:
        """Cache a held page under chain hash h; False if h is cached already."""
        if h in self._by_hash:
            return False
        if self._hash[page] is not None:
            raise PoolError(f"sliding page {page} published twice")
        self._by_hash[h] = page
        self._hash[page] = h
        return True

    def claim(self, page: int) -> None:
        self.num_idle -= 1

    def idle(self, page: int) -> None:
        self.num_idle += 1
        self._clock += 1
        self._stamp[page] = self._clock
        heapq.heappush(self._heap, (self._clock, page))
        if len(self._heap) > 2 * len(self._stamp) + 64:
            self._heap = [(s, p) for s, p in self._heap if self._evictable(s, p)]
            heapq.heapify(self._heap)

    def _evictable(self, stamp: int, page: int) -> bool:
        return (self._hash[page] is not None and not self._pool.refcount[page]
                and self._stamp[page] == stamp)

    def evict(self, n: int, best_effort: bool = False) -> list[int]:
        out: list[int] = []
        heap = self._heap
        while len(out) < n:
            if not heap:
                if best_effort:
                    break
                raise PoolError(f"evict({n}): only {len(out)} evictable")
            stamp, page = heapq.heappop(heap)
            if not self._evictable(stamp, page):
                continue
            del self._by_hash[self._hash[page]]
            self._hash[page] = None
            self.num_idle -= 1
            out.append(page)
        return out

    def check_invariants(self) -> None:
        rc = self._pool.refcount
        idle = 0
        for h, page in self._by_hash.items():
            if self._hash[page] != h:
                raise PoolError(f"sliding page {page}: index entry and page disagree")
            if self._pool.is_free(page):
                raise PoolError(f"cached sliding page {page} is on the free list")
            if rc[page] == 0:
                idle += 1
        if sum(h is not None for h in self._hash) != len(self._by_hash):
            raise PoolError("a sliding page names a hash the index lost")
        if idle != self.num_idle:
            raise PoolError(f"sliding num_idle={self.num_idle}, counted {idle}")
        live = {p for s, p in self._heap if self._stamp[p] == s}
        for page in self._by_hash.values():
            if rc[page] == 0 and page not in live:
                raise PoolError(f"idle sliding page {page} is not reachable for eviction")
