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
    every stream."""

    __slots__ = ("_loop", "_items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def pending(self) -> int:
        """Items put and not yet taken."""
        return len(self._items)

    def put(self, ev) -> None:
        self._items.append(ev)
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> collections.deque:
        """The events waiting, oldest first; waits for one if there is none."""
        while not self._items:
            self._waiter = self._loop.create_future()
            await self._waiter
        items, self._items = self._items, collections.deque()
        return items
