"""The device page pool: an O(1) free list and a reference count per page.

A page is in exactly one of three conditions:
  free    on the free list, refcount 0, not in the prefix index;
  cached  in the prefix index with refcount 0 (evictable, counted as free);
  held    refcount > 0 (a live request or a pin holds it).
"""

from __future__ import annotations


class PoolError(RuntimeError):
    """The pool was asked to do something that would corrupt it (a bug)."""


class PagePool:
    __slots__ = ("total", "refcount", "_free", "_is_free")

    def __init__(self, total: int):
        self.total = total
        self.refcount = [0] * total
        # pop() from the end hands out low page numbers first: easy to read in logs
        self._free = list(range(total - 1, -1, -1))
        self._is_free = [True] * total

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """n pages off the free list, each with refcount 1."""
        if n > len(self._free):
            raise PoolError(f"take({n}) with {len(self._free)} free")
        free, rc, is_free = self._free, self.refcount, self._is_free
        pages = free[len(free) - n:]
        del free[len(free) - n:]
        for p in pages:
            rc[p] = 1
            is_free[p] = False
        return pages

    def put_free(self, page: int) -> None:
        if self._is_free[page] or self.refcount[page]:
            raise PoolError(f"page {page} freed twice or while held")
        self._is_free[page] = True
        self._free.append(page)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def check_invariants(self) -> None:
        seen = set(self._free)
        if len(seen) != len(self._free):
            raise PoolError("free list holds a page twice")
        for p in range(self.total):
            if (p in seen) != self._is_free[p]:
                raise PoolError(f"page {p}: free flag disagrees with the free list")
            if self._is_free[p] and self.refcount[p]:
                raise PoolError(f"page {p} is free with refcount {self.refcount[p]}")
            if self.refcount[p] < 0:
                raise PoolError(f"page {p} has negative refcount")
