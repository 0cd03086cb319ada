"""The disk tier's files beyond full-history pages (engine/disk/tier.py):
a state model's checkpoints (`StateFiles`, and `HostCheckpoints`, which host
slot holds which chain's checkpoint under selective writes) and a sliding
group's window tails (`WindowFiles`)."""

from __future__ import annotations

from dataclasses import dataclass

# How many chains the edge remembers writing (to skip writing them again) and
# counting hits on: bounded, so a long-running engine's memory is too.
REMEMBERED = 1 << 20


@dataclass(frozen=True)
class StateFiles:
    """A state model's checkpoints on disk: its state group, the pages
    between checkpoints, and a slot's layout (the key's)."""
    group: int
    block_pages: int
    layout: str


class HostCheckpoints:
    """Which host slot of a state model's host state cache holds the
    checkpoint of which chain (selective writes: a checkpoint is written
    when the page it ends is, maybe rounds after it reached host)."""

    def __init__(self):
        self.host = None                            # the host state cache (set each round)
        self._slot: dict[int, int] = {}             # chain -> host slot
        self._chain: dict[int, int] = {}            # host slot -> chain

    def stored(self, chain: int, slot: int) -> None:
        self.overwritten([slot])
        if len(self._slot) >= REMEMBERED:
            self._slot.clear()
            self._chain.clear()
        self._slot[chain], self._chain[slot] = slot, chain

    def overwritten(self, slots) -> None:
        """Slots written with something else (a snapshot, a disk read)."""
        for hp in slots:
            chain = self._chain.pop(hp, None)
            if chain is not None and self._slot.get(chain) == hp:
                del self._slot[chain]

    def slot(self, chain: int) -> int | None:
        return self._slot.get(chain)


@dataclass(frozen=True)
class WindowFiles:
    """A sliding-window group's window tails on disk: its group, window
    (tokens a query sees, itself included) and a page's layout (the key's).
    A tail page is keyed by the chain hash of the prefix it ends, as the
    full-history page of the same slot is."""
    group: int
    window: int
    layout: str

    def tail(self, end: int, page_size: int) -> range:
        """The slots a hit ending at page `end` needs of this group: those
        the first query after it reads (cache_groups.first_live_page)."""
        return range(max(end * page_size - self.window + 1, 0) // page_size, end)


def window_files(groups, caches) -> tuple:
    """The WindowFiles of each cached (non-replayable) sliding group of an
    executor's `groups` (CacheGroupSpec) and `caches` (their device pools)."""
    return tuple(WindowFiles(g, spec.window, caches[g].layout())
                 for g, spec in enumerate(groups) if spec.sliding and not spec.replayable)
