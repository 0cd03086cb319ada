"""The draft model's own pages: which pages of the drafter's paged cache
each request holds, and which tokens' K/V they hold.

Not a planner cache group (yet): the drafter keeps this table by request
id, beside the planner, and trusts a request's K/V only as far as the
tokens it was computed from equal the request's context now. Whatever the
planner did meanwhile (a verify that rejected candidates, a retraction, a
prefix hit, a request that arrived on D from P) shows as a shorter common
prefix, and the drafter recomputes from there. Short of free pages it lets
go of the request drafted longest ago (a guess, recomputed when asked
again); a request that cannot fit even then gets no candidates.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class DraftEntry:
    pages: list = field(default_factory=list)   # page i holds positions [i*ps, (i+1)*ps)
    tokens: list = field(default_factory=list)  # the tokens whose K/V the pages hold, in order


class DraftPages:
    def __init__(self, pages: int, page_size: int):
        if pages < 1 or page_size < 1:
            raise ValueError(f"draft pages: {pages} pages of {page_size} tokens; give both >= 1")
        self.total, self.page_size = pages, page_size
        self.free = list(range(pages - 1, -1, -1))
        # request id -> its entry, least recently drafted first
        self.entries: OrderedDict[str, DraftEntry] = OrderedDict()
        self.evictions = 0          # entries let go of for another's pages
        self.recomputed = 0         # tokens fed again because the cache did not hold them

    def reserve(self, req_id: str, context: list, positions: int, busy: set) -> int | None:
        """Make `req_id` hold pages for `positions` positions and return how
        many of `context`'s tokens its pages hold K/V for already (at most
        all but the last: the drafter feeds at least that one); None if the
        pool cannot hold it even after letting go of every entry not in
        `busy` (then it keeps what it had)."""
        e = self.entries.get(req_id)
        if e is None:
            e = self.entries[req_id] = DraftEntry()
        self.entries.move_to_end(req_id)
        valid = _common_prefix(e.tokens, context, len(context) - 1)
        self.recomputed += max(len(context) - 1 - valid, 0) if e.tokens else 0
        del e.tokens[valid:]
        need = -(-positions // self.page_size) - len(e.pages)
        while need > len(self.free):
            victim = next((r for r in self.entries if r != req_id and r not in busy), None)
            if victim is None:
                return None
            self.drop(victim)
            self.evictions += 1
        for _ in range(max(need, 0)):
            e.pages.append(self.free.pop())
        return valid

    def table(self, req_id: str) -> list:
        return self.entries[req_id].pages

    def wrote(self, req_id: str, tokens: list) -> None:
        """`req_id`'s pages now hold the K/V of `tokens` (its context and the
        candidates fed after it)."""
        self.entries[req_id].tokens[:] = tokens

    def drop(self, req_id: str) -> None:
        e = self.entries.pop(req_id, None)
        if e is not None:
            self.free.extend(reversed(e.pages))

    def check_invariants(self) -> None:
        held = [p for e in self.entries.values() for p in e.pages]
        assert len(held) == len(set(held)), "a draft page is held twice"
        assert not set(held) & set(self.free), "a held draft page is on the free list"
        assert len(held) + len(self.free) == self.total, "a draft page leaked"
        for rid, e in self.entries.items():
            assert len(e.tokens) <= len(e.pages) * self.page_size, f"{rid}: K/V beyond its pages"


def _common_prefix(a: list, b: list, cap: int) -> int:
    n = min(len(a), len(b), max(cap, 0))
    if a[:n] == b[:n]:              # the usual case, compared in C
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
