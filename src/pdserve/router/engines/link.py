"""The router's link to one engine: a long-lived Subscribe stream that
carries, batched per engine round, the events of every request this router
submitted there, dispatched to each request's `Mailbox`. When the stream
breaks (the engine died or restarted), every request waiting on it is told
(`LOST`) and the link reconnects, following the stub membership keeps
current."""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging

import grpc

from pdserve.router.engines.pairing import EngineRef
from pdserve.router.mailbox import Mailbox
from pdserve.proto import control_pb2 as cpb

log = logging.getLogger("pdserve.router")

RECONNECT_S = 0.2
SUBMITS_IN_FLIGHT = 128  # Submit calls at once to one engine (it takes them on 32 threads)


class LinkSignal(enum.Enum):
    """What a link puts in a request's mailbox besides the engine's events."""

    LOST = enum.auto()   # the engine's stream broke: nothing of the request is left there


LOST = LinkSignal.LOST


class EngineLink:
    def __init__(self, ref: EngineRef, router_id: str):
        self.ref = ref
        self.router_id = router_id
        self.subscriber = ""                      # the live subscription's id
        self.ready = asyncio.Event()
        self.ended = asyncio.Event()              # the last live stream ended (all read)
        self.requests: dict[str, Mailbox] = {}
        self.submits = asyncio.Semaphore(SUBMITS_IN_FLIGHT)
        self._ids = itertools.count(1)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            # a fresh id each time: the engine aborts an ended subscription's
            # requests, never a newer one's
            sub = f"{self.router_id}/{next(self._ids)}"
            try:
                call = self.ref.control.Subscribe(cpb.SubscribeRequest(subscriber=sub))
                async for msg in call:
                    if not self.ready.is_set():
                        self.subscriber = sub
                        self.ended.clear()
                        self.ready.set()
                    for ev in msg.events:
                        box = self.requests.get(ev.request_id)
                        if box is not None:
                            box.put(ev)
            except grpc.aio.AioRpcError:
                pass                              # the engine is gone: tell, then retry
            except asyncio.CancelledError:
                task = asyncio.current_task()
                assert task is not None           # _run runs as a task (start())
                if task.cancelling():
                    raise                         # stop(): the link itself ends
                # the call was cancelled under it: membership closed its channel
                # (the engine moved); a broken stream like any other
            if self.ready.is_set():               # it was up: down until membership sees it
                self.ref.alive = False
                self.ended.set()
            self.ready.clear()
            for box in self.requests.values():
                box.put(LOST)
            self.requests.clear()
            await asyncio.sleep(RECONNECT_S)
