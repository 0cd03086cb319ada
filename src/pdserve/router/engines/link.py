"""The router's link to one engine: a long-lived Subscribe stream that
carries, batched per engine round, the events of every request this router
submitted there, dispatched to each request's `Mailbox`. When the stream
breaks (the engine died or restarted, or keepalive found it silent:
proto/keepalive.py), every request waiting on it is told (`LOST`) and the
link reconnects, following the stub membership keeps current.

The link also watches the engine's liveness, since a stream can stay open
while nothing comes: every probe period (PROBE_S, or a quarter of
router.engine_silent_s when that is shorter) it asks GetInfo (which the engine
answers off its loop, with its watchdog's verdict: engine/watchdog.py) and
checks (`check`). An engine that says it is unhealthy, or has not answered
healthy for router.engine_silent_s, is picked no more, and each request
that has heard nothing from it for that long is told (`STALLED`): its
stream moves it to another engine as after a LOST, and leaves its id in
the engine's `orphans`. The link aborts those there (again at once when
the engine answers healthy after an attempt while it was not), so no copy
runs on once the engine comes back."""

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
PROBE_S = 1.0            # how often the link asks its engine how it is, and checks, at most
PROBES_PER_SILENCE = 4   # ... and at least this often per engine_silent_s
LAG_S = 1.0              # a check this much later than PROBE_S: the router itself stalled
SILENT_S = 5.0           # router.engine_silent_s's default
ORPHAN_ABORT_S = 10.0    # an Abort of a request moved off the engine


class LinkSignal(enum.Enum):
    """What a link puts in a request's mailbox besides the engine's events."""

    LOST = enum.auto()     # the engine's stream broke: nothing of the request is left there
    STALLED = enum.auto()  # the engine is unhealthy or silent and sent the request nothing
                           # for engine_silent_s: it may still hold it (an orphan to abort)


LOST = LinkSignal.LOST
STALLED = LinkSignal.STALLED


def probe_period(silent_s: float) -> float:
    """How often a link probes and checks: at most PROBE_S apart, and
    PROBES_PER_SILENCE times per engine_silent_s, so that a short
    engine_silent_s is not stretched by up to three probe periods (the
    probe that sees the verdict, the check that stalls the request, the
    check that aborts its copy)."""
    return min(PROBE_S, silent_s / PROBES_PER_SILENCE)


class EngineLink:
    def __init__(self, ref: EngineRef, router_id: str, silent_s: float = SILENT_S):
        self.ref = ref
        self.router_id = router_id
        self.silent_s = silent_s                  # router.engine_silent_s
        self.probe_s = probe_period(silent_s)
        self.subscriber = ""                      # the live subscription's id
        self.ready = asyncio.Event()
        self.ended = asyncio.Event()              # the last live stream ended (all read)
        self.requests: dict[str, Mailbox] = {}
        self.submits = asyncio.Semaphore(SUBMITS_IN_FLIGHT)
        self._ids = itertools.count(1)
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._aborting: asyncio.Future | None = None   # the orphans' Aborts in flight
        self._aborted_unhealthy = False           # ... sent while the engine was not healthy

    def start(self) -> None:
        self.ref.healthy_at = asyncio.get_running_loop().time()   # silent from now on, if so
        self._task = asyncio.ensure_future(self._run())
        self._watcher = asyncio.ensure_future(self._watch())

    def stop(self) -> None:
        for task in (self._task, self._watcher, self._aborting):
            if task is not None:
                task.cancel()

    # ---- liveness ------------------------------------------------------------------
    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        probe: asyncio.Future | None = None
        last = loop.time()
        try:
            while True:
                now = loop.time()
                if now - last > self.probe_s + LAG_S:   # the router was frozen or starved
                    self.excuse(now - last - self.probe_s)
                last = now
                if probe is None or probe.done():     # one GetInfo in flight at most
                    probe = asyncio.ensure_future(self._probe())
                self.check(now)
                await asyncio.sleep(self.probe_s)
        finally:
            if probe is not None:
                probe.cancel()

    def excuse(self, seconds: float) -> None:
        """The router itself did not run for `seconds` (it was frozen, or
        its loop was held up): that time counts neither as the engine's
        silence nor as its requests' quiet. (Unexcused, a router thawed
        after 45 s took every engine for silent, refused new requests and
        moved every quiet one.)"""
        self.ref.healthy_at += seconds
        for box in self.requests.values():
            box.put_at += seconds

    async def _probe(self) -> None:
        try:
            info = await self.ref.control.GetInfo(cpb.InfoRequest(), timeout=self.silent_s)
        except grpc.aio.AioRpcError:
            return                                # no answer: check() counts the silence
        self.answered(info, asyncio.get_running_loop().time())

    def answered(self, info: cpb.InfoResponse, now: float) -> None:
        """The engine's answer at `now`: its own verdict and readings."""
        ref = self.ref
        was = ref.unhealthy
        ref.unhealthy = info.unhealthy
        ref.loop_quiet_s, ref.outputs_busy_s = info.loop_quiet_s, info.outputs_busy_s
        if not info.unhealthy:
            ref.healthy_at = now
            if ref.orphans and was and self._aborted_unhealthy:
                self._abort_orphans()             # the last try may be dropped as stale

    def check(self, now: float) -> int:
        """Silence counted, orphans aborted, and, while the engine is
        unhealthy or silent, each request that heard nothing from it for
        engine_silent_s told STALLED (and forgotten here); returns how many."""
        ref = self.ref
        quiet = now - ref.healthy_at
        if not ref.unhealthy and quiet >= self.silent_s:
            ref.unhealthy = f"silent: no healthy answer for {quiet:.1f} s"
        if ref.orphans and (self._aborting is None or self._aborting.done()):
            self._abort_orphans()
        if not ref.unhealthy:
            return 0
        stalled = [rid for rid, box in self.requests.items()
                   if now - box.put_at >= self.silent_s]
        for rid in stalled:
            self.requests.pop(rid).sound(STALLED)
        return len(stalled)

    def _abort_orphans(self) -> None:
        self._aborted_unhealthy = bool(self.ref.unhealthy)
        self._aborting = asyncio.ensure_future(self._abort(sorted(self.ref.orphans)))

    async def _abort(self, rids: list[str]) -> None:
        """Abort requests moved off the engine; each it answers for (taken
        away, or not there) is forgotten, the rest are tried again."""
        ref = self.ref
        got = await asyncio.gather(*(ref.control.Abort(cpb.AbortEngineRequest(
            request_id=rid, reason="moved to another engine while this one was unhealthy"),
            timeout=ORPHAN_ABORT_S) for rid in rids), return_exceptions=True)
        for rid, res in zip(rids, got):
            if not isinstance(res, BaseException):
                ref.orphans.discard(rid)

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
