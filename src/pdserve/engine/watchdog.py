"""An engine's liveness: do its two working threads make progress?

The loop thread stamps `EngineLoop.passed_at` at the end of every pass (a
pass waits at most IDLE_WAIT_S for a job, so a loop that works passes many
times a second, idle or not); the output thread stamps `Outputs.busy_since`
when it takes a batch and clears it when the batch is out (idle, it waits
for the next and is behind on nothing). `Watchdog.health()` reads the two
on whichever thread asks: the GetInfo handler, never the loop, which may be
what is stuck.

    loop quiet, or one batch on the output thread, for `stall_s`
        -> unhealthy: GetInfo says why; the router moves the engine's
           requests elsewhere (router/engines/link.py) and picks it no more
    either for `restart_s`
        -> `on_stuck(why)`, once: on a deployment the process exits and
           Ray restarts the engine (cluster/actors.py)

Only the restart needs a thread of its own (a stuck loop cannot notice
itself); it wakes every CHECK_S.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("pdserve.engine")

CHECK_S = 1.0     # how often the restart thread looks


@dataclass(frozen=True)
class Health:
    """An engine's liveness at one moment (what GetInfo carries)."""
    loop_quiet_s: float         # since the loop thread last ended a pass (0: not started)
    outputs_busy_s: float       # the output thread on its current batch (0: waiting for one)
    unhealthy: str              # why the engine is not healthy; "" when it is

    @property
    def stuck_s(self) -> float:
        """How long the slower of the two threads has made no progress."""
        return max(self.loop_quiet_s, self.outputs_busy_s)


@dataclass(frozen=True)
class WatchdogLimits:
    """engine.stall_unhealthy_s and engine.stuck_loop_restart_s."""
    stall_s: float = 5.0        # no progress this long: unhealthy
    restart_s: float = 60.0     # this long: restarted (0: never)


class Watchdog:
    def __init__(self, name: str, limits: WatchdogLimits,
                 loop_passed: Callable[[], float | None],
                 outputs_busy: Callable[[], float | None],
                 on_stuck: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """`loop_passed()`: when the loop last ended a pass (None: not
        running); `outputs_busy()`: since when the output thread holds its
        current batch (None: it holds none); both time.monotonic() as
        `clock` reads it. `on_stuck(why)`: what a stuck engine does past
        `limits.restart_s` (None: only log it)."""
        self.name = name
        self.limits = limits
        self._loop_passed = loop_passed
        self._outputs_busy = outputs_busy
        self._on_stuck = on_stuck
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = ""                 # why on_stuck ran ("" until it does)

    def health(self) -> Health:
        """Safe from any thread: it only reads two timestamps."""
        if self._stop.is_set():
            return Health(0.0, 0.0, "")   # stopped (drained): nothing of it to watch
        now = self._clock()
        passed, busy = self._loop_passed(), self._outputs_busy()
        quiet = 0.0 if passed is None else max(now - passed, 0.0)
        held = 0.0 if busy is None else max(now - busy, 0.0)
        why = []
        if quiet >= self.limits.stall_s:
            why.append(f"loop thread stuck for {quiet:.1f} s")
        if held >= self.limits.stall_s:
            why.append(f"output thread stuck on one batch for {held:.1f} s")
        return Health(quiet, held, "; ".join(why))

    def check(self) -> bool:
        """Run `on_stuck` once if a thread has been stuck past the restart
        limit; True if it ran now."""
        limit = self.limits.restart_s
        if not limit or self.fired:
            return False
        h = self.health()
        if h.stuck_s < limit:
            return False
        self.fired = f"{h.unhealthy} (engine.stuck_loop_restart_s is {limit:g} s)"
        log.critical("%s: %s", self.name, self.fired)
        if self._on_stuck is not None:
            self._on_stuck(self.fired)
        return True

    def start(self) -> None:
        if not self.limits.restart_s:
            return
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No more watching: the engine drained and stopped, or shuts down."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            self.check()
