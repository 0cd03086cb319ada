"""`Mailbox`: a one-reader hand-off on an event loop. The router gives each
request one for its engine's events and each GenerateMany call one for its
responses; the async client gives each multiplexed request one."""

from __future__ import annotations

import asyncio
import collections


class Mailbox:
    """Items handed from one side of an event loop to the other, in order:
    the producer puts and never waits; the consumer takes all that came at
    once. asyncio.Queue did the same in pure Python and asked for the
    running loop (a getpid system call) on each wait, once per token of
    every stream.

    `put_at` is when the last item came (loop time; made: when the box
    was): how long its reader has heard nothing. An `alarm()` is for a
    reader busy elsewhere (a request whose Submit is in flight) that must
    hear at once of an item `sound` puts (a link giving up on its engine)."""

    __slots__ = ("_loop", "_items", "_waiter", "put_at", "_alarm")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._alarm: asyncio.Future | None = None
        self.put_at = loop.time()

    def pending(self) -> int:
        """Items put and not yet taken."""
        return len(self._items)

    def put(self, ev) -> None:
        self._items.append(ev)
        self.put_at = self._loop.time()
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    def sound(self, ev) -> None:
        """Put `ev`, and set the alarm (if one is wanted) to it."""
        self.put(ev)
        if self._alarm is not None and not self._alarm.done():
            self._alarm.set_result(ev)

    def alarm(self) -> asyncio.Future:
        """A future `sound` sets to the item it put (never cancelled here)."""
        if self._alarm is None:
            self._alarm = self._loop.create_future()
        return self._alarm

    async def take(self) -> collections.deque:
        """The events waiting, oldest first; waits for one if there is none."""
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        items, self._items = self._items, collections.deque()
        return items
