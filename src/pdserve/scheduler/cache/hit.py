"""The prefix hit: the longest cached prefix every cache group can serve.

The full-history group's device chain is matched first and continued on
the host tier; the hit is then cut back until each cached sliding group
holds the lookback its first new query reads and the state group a
checkpoint at its end (spec §1.2, §1.3). A lookup reads the indexes and
changes nothing: the coordinator (coordinator.py) claims a hit, and loads
its host part, only when it admits the request.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pdserve.scheduler.cache.prefix import ROOT_HASH, chain_hash


class Hit:
    """A prefix hit every group can serve: slots [0, pages) are cached.
    `device[g]` are group g's device pages for slots [first[g], device_end)
    (a sliding group's lookback; none for a replayable group), `host` the
    full-history group's host pages for slots [device_end, pages), and
    `state_host` the host slot of the state checkpoint at the hit's end when
    the device has none (-1: it has, or there is no state group), and `disk`
    how many of the last pages the disk tier serves (slots [pages - disk,
    pages), read through host pages; `with_disk`), and `state_disk`
    whether the state checkpoint at its end is read from disk with them
    (`Coordinator.disk_hit`)."""

    __slots__ = ("pages", "device_end", "device", "first", "host", "tail", "state_host",
                 "disk", "state_disk", "window_disk")

    def __init__(self, pages: int, device: list, first: list, host: list, tail: int,
                 state_host: int = -1, disk: int = 0):
        self.pages = pages
        self.disk = disk
        self.device_end = pages - len(host) - disk
        self.device = device
        self.first = first
        self.host = host
        self.tail = tail              # chain hash of the prefix [0, device_end)
        self.state_host = state_host
        self.state_disk = False
        self.window_disk = False      # each cached window's tail at its end read from disk


def longest_hit(coord, req, max_pages: int, sliding: bool = True, use_host: bool = True) -> Hit:
    """The longest cached prefix of at most max_pages pages that every
    group of `coord` can serve: the full-history group's device chain
    continued on host, cut back until each cached sliding group holds the
    lookback its first new query reads (its last W - 1 positions) and the
    state group a checkpoint at its end (§1.2: a hit restores the nearest
    published checkpoint at or before it, on the device or, with
    `use_host`, on host). `sliding` False: only the full history is asked
    (a D landing receives the sliding windows and the state from the
    peer). Pure."""
    keys, dev, host = _history(coord, req, max_pages, sliding, use_host)
    n = len(dev) + len(host) if coord.full is not None else len(keys)
    n_groups = len(coord.groups)
    first = [0] * n_groups
    device: list[list[int]] = [[] for _ in range(n_groups)]
    device[0] = dev
    hashes = []
    state_host = -1
    if sliding and coord.keyed and n:
        n, hashes, served, state_host = _keyed(coord, keys, n, use_host)
        for g, (lo, pages) in served.items():
            first[g], device[g] = lo, pages
    if coord.full is None:
        return Hit(n, device, first, [], hashes[n - 1] if n else ROOT_HASH)
    index = coord.groups[0].index
    if n <= len(dev):
        device[0] = dev[:n]
        return Hit(n, device, first, [], index.hash_of(dev[n - 1]) if n else ROOT_HASH,
                   state_host)
    return Hit(n, device, first, host[:n - len(dev)],
               index.hash_of(dev[-1]) if dev else ROOT_HASH, state_host)


def _history(coord, req, max_pages: int, sliding: bool, use_host: bool) -> tuple:
    """(the page keys, made as far as a matcher read them, the
    full-history group's cached device chain, the host pages continuing
    it). Without a full-history group: every key when a cached sliding
    group is asked, else none; no pages."""
    ps = coord.page_size
    keys = []
    if coord.full is None:
        if coord.cached_sliding and sliding:
            keys = [req.page_key(i, ps) for i in range(max_pages)]
        return keys, [], []

    def more():
        for i in range(max_pages):
            keys.append(req.page_key(i, ps))
            yield keys[-1]
    index = coord.groups[0].index
    it = more()
    dev = index.match(it)
    host = []
    if use_host and coord.host is not None and len(dev) < max_pages:
        parent = index.hash_of(dev[-1]) if dev else ROOT_HASH
        host = coord.host.index.match(itertools.chain(keys[len(dev):], it), parent)
    return keys, dev, host


def _keyed(coord, keys: list, n: int, use_host: bool) -> tuple:
    """The n-page hit cut back to what every keyed group (cached sliding,
    state) serves: (its pages, the chain hashes of the first n keys, per
    keyed group its first live slot and device pages, and the host slot
    of the state checkpoint at the hit's end when the device has none,
    else -1)."""
    groups, ps = coord.groups, coord.page_size
    hashes = []
    h = ROOT_HASH
    for key in keys[:n]:
        h = chain_hash(h, key)
        hashes.append(h)
    found = {g: [groups[g].index.find(x) for x in hashes] for g in coord.keyed}
    s = coord.state
    on_host = [None] * n
    if s in found and use_host and coord.hosts:
        # a checkpoint the device evicted may still be on host
        on_host = [coord.hosts[s].index.find(x) for x in hashes]
        cut = dict(found)
        cut[s] = [d if d is not None else h for d, h in zip(found[s], on_host)]
        n = _sliding_cut(coord, cut, n)
    else:
        n = _sliding_cut(coord, found, n)
    served = {}
    for g in coord.keyed:
        lo = groups[g].first_live(n * ps)
        served[g] = (lo, [p for p in found[g][lo:n] if p is not None] if g == s
                     else found[g][lo:n])
    state_host = on_host[n - 1] if s in found and n and not served[s][1] else -1
    return n, hashes, served, state_host


def _sliding_cut(coord, found: dict, n: int) -> int:
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
    ps = coord.groups[0].page_size

    def serves(g, m):
        grp = coord.groups[g]
        if grp.spec.state:
            return found[g][m - 1] is not None and grp.aligned(m * ps)
        lo = grp.first_live(m * ps)
        return runs[g][m - 1] <= lo or lo >= m

    for m in range(n, 0, -1):
        if all(serves(g, m) for g in found):
            return m
    return 0


def with_disk(hit: Hit, pages: int) -> Hit:
    """`hit` continued by `pages` pages the disk tier serves (after its
    device and host parts; a full-history group alone)."""
    if not pages:
        return hit
    return Hit(hit.pages + pages, hit.device, hit.first, hit.host, hit.tail, hit.state_host,
               hit.disk + pages)


@dataclass
class HitCounts:
    """Prompt tokens first admissions found cached, by tier (an engine's
    prefix-cache metrics and what `usage.prompt_tokens_details` sums)."""
    queries: int = 0            # first admissions that looked a prompt up
    prompt_tokens: int = 0      # their prompt tokens
    device_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0
    disk_missed: int = 0        # disk hits whose read missed after admission (§4)

    def count(self, prompt_tokens: int, cached: tuple) -> None:
        self.queries += 1
        self.prompt_tokens += prompt_tokens
        self.device_tokens += cached[0]
        self.host_tokens += cached[1]
        self.disk_tokens += cached[2]
