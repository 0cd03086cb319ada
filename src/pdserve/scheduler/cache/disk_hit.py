"""A prefix hit continued over the disk (L3) tier's pages.

The engine's probe of the disk tier rides on the request
(`Request.disk_pages`); the coordinator's `disk_hit` continues a hit that
`longest_hit` found on device and host (hit.py) over those pages, where the
coordinator `serves_disk`: shortened to the host pages that could stage
them, rounded down to the prefix granularity (spec §1), and, beside cached
sliding groups or a state group, kept only where it ends exactly at the
window tails or the checkpoint the probe found. Admission then reads the
disk pages through host pages (coordinator.py). Pure: nothing is claimed.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.scheduler.cache.hit import Hit, with_disk
from pdserve.scheduler.cache.host_tier import HostCache


class DiskHitView(Protocol):
    """What a disk continuation reads of the coordinator (coordinator.py,
    which calls it): whether a disk hit can be read there, the groups it
    must end exactly at, and the host tier that stages it."""

    @property
    def serves_disk(self) -> bool: ...

    @property
    def host_cache(self) -> HostCache: ...

    @property
    def cached_sliding(self) -> list[int]: ...

    @property
    def state(self) -> int | None: ...

    def window_tail(self, g: int, end: int) -> range: ...


def continue_on_disk(coord: DiskHitView, req, hit: Hit, max_pages: int,
                     granularity: int, landing: bool = False) -> Hit:
    """`hit` continued over the pages the disk tier holds beyond it
    (`req.disk_pages`, at most `max_pages` in all), shortened to what
    the host tier can stage and rounded down to `granularity` pages
    (spec §1: a prefetch that cannot allocate every probed page is
    shortened, never partly trusted). `landing`: D's remote admission,
    whose state comes from the peer (no checkpoint is read). Pure."""
    want = min(req.disk_pages, max_pages) - hit.pages
    if want <= 0 or not coord.serves_disk:
        return hit
    room = coord.host_cache.disk_room(hit.host)
    end = hit.pages + max(min(want, room), 0)
    end -= end % granularity
    if end <= hit.pages:
        return hit
    if coord.cached_sliding and not landing:
        return _window_disk_hit(coord, req, hit, end)
    s = coord.state
    if s is not None and not landing:
        # the state at the hit's end comes from disk: the probe found a
        # checkpoint at req.disk_pages only, so nothing shorter is read
        if end != req.disk_pages or not coord.host_cache.state_disk_room():
            return hit
        device, first = list(hit.device), list(hit.first)
        device[s], first[s] = [], 0
        hit = with_disk(Hit(hit.pages, device, first, hit.host, hit.tail, -1, hit.disk),
                        end - hit.pages)
        hit.state_disk = True
        return hit
    return with_disk(hit, end - hit.pages)


def _window_disk_hit(coord: DiskHitView, req, hit: Hit, end: int) -> Hit:
    """A disk hit beside cached sliding groups: it ends exactly where
    the probe found each group's window tail (`req.disk_pages`), read
    from disk with the full history's pages, through the group's host
    tier; the device lookback of the shorter hit is not claimed."""
    if end != req.disk_pages or any(
            not coord.host_cache.window_disk_room(g, len(coord.window_tail(g, end)))
            for g in coord.cached_sliding):
        return hit
    device, first = list(hit.device), list(hit.first)
    for g in coord.cached_sliding:
        device[g], first[g] = [], 0
    hit = with_disk(Hit(hit.pages, device, first, hit.host, hit.tail, hit.state_host,
                        hit.disk), end - hit.pages)
    hit.window_disk = True
    return hit
