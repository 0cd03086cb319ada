"""Graceful drain of one engine.

A draining engine takes no new request: Submit and RemotePrefill are
refused with `EngineDraining` (FAILED_PRECONDITION on the wire), which the
router answers by submitting elsewhere and a D answers by prefilling
locally. It finishes what it holds (P: its prefills, their transfers and
D's acks; D and fused: their streams) and, on the first idle round with
nothing live, stops: the inbox is closed to new work, so an engine with
nothing running has nothing left to do. At the deadline whatever is still
live is aborted with `DEADLINE_ABORT` (error kind DEADLINE on the wire: the
router answers UNAVAILABLE, which clients retry), so every request either
finishes or ends with an error its client sees.

    serving --begin(deadline)--> draining --idle, nothing live--> stopped
                                    | deadline passed: abort what is left
                                    +--------------------------------^

The loop thread owns this state; the Drain RPC's thread only waits on
`stopped` and then reads `report`.
"""

from __future__ import annotations

import threading

from pdserve.proto import router_pb2 as rpb

DEADLINE_ABORT = "engine drained: deadline passed"
DEFAULT_DEADLINE_S = 60.0
STOP_GRACE_S = 5.0          # after the stop, in-flight RPCs (the Drain answer, streams' tails)


class EngineDraining(Exception):
    """The engine is draining and takes no new work; the work itself is
    fine and should go to another engine."""


class EngineStopped(RuntimeError):
    """The engine drained and stopped; its loop runs nothing more."""


class Drain:
    def __init__(self, name: str):
        self.name = name
        self.deadline: float | None = None      # None: serving
        self.started = 0.0
        self.at_start = 0
        self.refused = 0
        self.aborted = 0
        self.deadline_passed = False
        self.stopped = threading.Event()
        self.report: rpb.DrainResponse | None = None

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def begin(self, now: float, deadline_s: float, live: int) -> None:
        """Start draining (loop thread). A second call never extends the
        deadline, only brings it nearer."""
        if deadline_s < 0:
            raise ValueError(f"drain deadline must be >= 0 seconds, got {deadline_s}")
        if self.deadline is None:
            self.started, self.at_start, self.deadline = now, live, now + deadline_s
        else:
            self.deadline = min(self.deadline, now + deadline_s)

    def refuse(self, what: str) -> None:
        """Raise EngineDraining if the engine drains: new `what` goes elsewhere."""
        if self.deadline is not None:
            self.refused += 1
            raise EngineDraining(f"{self.name} is draining and takes no new {what}; "
                                 "send it to another engine")

    def due(self, now: float) -> bool:
        """The deadline passed and what is left has not been aborted yet."""
        return self.deadline is not None and not self.deadline_passed and now >= self.deadline

    def aborted_left(self, count: int) -> None:
        self.deadline_passed = True
        self.aborted += count

    def finish(self, now: float, used_pages: int) -> rpb.DrainResponse:
        """Nothing is live: the report the Drain RPC answers with."""
        self.report = rpb.DrainResponse(
            engine=self.name, deadline_passed=self.deadline_passed,
            requests_at_start=self.at_start, aborted=self.aborted, refused=self.refused,
            seconds=now - self.started, used_pages=used_pages)
        return self.report
