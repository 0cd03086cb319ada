"""The engine's loop thread: the only thread that touches the planner,
executor and transport.

    pass:  transfer events and the peer protocol's timers
           jobs from the inbox (gRPC handlers, the output thread), each
           dropped unrun if its caller gave up waiting for it
           the drain's deadline
           a round: plan, forward, apply; its outputs to the output thread,
           its asks and ships to the peers (with engine.overlap the round's
           step builds the next plan while this one's forward runs, and an
           abort that waited for its forward is finished here, after_abort)

The clocks come before the queue: an engine that was frozen (a GC or swap
pause, SIGSTOP) first expires the leases and landings that ran out while it
slept, then runs what queued up meanwhile, so an old heartbeat cannot
renew a lease that expired, and the handlers' jobs whose callers gave up
(a RemotePrefill D stopped waiting for) are not run at all.

`Inbox` is how other threads reach it; `EngineLoop` runs the passes and
hands each round's results to the output thread (`output_item`). The
server it serves (engine_server.py) owns both, and the requests' bookkeeping
(whose subscription, what ended) that the loop reports to: the loop is
given the parts it drives and `LoopHooks`, the server's calls it makes,
not the server.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.engine.drain import Drain
from pdserve.engine.engine import Engine
from pdserve.engine.stats import EngineCounters
from pdserve.engine.outputs import ErrorKind, OutputItem, Outputs
from pdserve.engine.peer.protocol import PeerProtocol
from pdserve.engine.rounds import round_of
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.request import Request
from pdserve.transfer import KvTransport

log = logging.getLogger("pdserve.engine")

ROUNDS_KEPT = 20_000      # timed rounds kept for `take_rounds` (the oldest go first)
# how long a pass waits for a job: while requests or transfers are live, briefly
# (transfer events and timers are polled between waits); with nothing live, longer
# (a job still wakes it at once; only timers wait, at most this long)
POLL_S = 0.002
IDLE_WAIT_S = 0.02
ERRORS_KEPT = 20


@dataclass(frozen=True)
class Job:
    """A closure for the loop thread, and until when its caller waits for
    it: past `deadline` (time.monotonic()) the caller has given up, and the
    job is dropped unrun. None: the poster does not give up (the loop's own
    work, posted by its other threads)."""
    run: Callable[[], None]
    deadline: float | None = None
    dropped: Callable[[], None] | None = None    # told when it is dropped (its caller, at once)


class Inbox:
    """Jobs for the loop thread to run between rounds; closed once the
    engine has drained and stopped (a post then says so). `on_stale` is
    called for each job dropped because its caller had given up."""

    def __init__(self, on_stale: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self._jobs: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()     # a post wakes `wait`; closing against a racing post
        self._closed = False
        self._on_stale = on_stale
        self.clock = clock

    def post(self, job: Callable[[], None], deadline: float | None = None,
             dropped: Callable[[], None] | None = None) -> bool:
        """Queue `job` (to run before `deadline`, if given; `dropped` is
        called instead if it cannot); False once the inbox is closed."""
        with self._cv:
            if self._closed:
                return False
            self._jobs.append(Job(job, deadline, dropped))
            self._cv.notify()
            return True

    def close(self) -> None:
        with self._cv:
            self._closed = True

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a job to be queued; runs none.
        True if one is."""
        with self._cv:
            return bool(self._jobs) or self._cv.wait_for(lambda: bool(self._jobs), timeout)

    def run_pending(self) -> bool:
        """Run every job queued now (and any they post), waiting for none; a
        job whose caller gave up is dropped. True if any was taken. A job's
        exception propagates (the loop logs it)."""
        took = False
        while True:
            with self._cv:
                if not self._jobs:
                    return took
                job = self._jobs.popleft()
            took = True
            if job.deadline is not None and self.clock() >= job.deadline:
                self._on_stale()
                if job.dropped is not None:
                    job.dropped()
                continue
            job.run()


@dataclass(frozen=True)
class LoopHooks:
    """What the loop calls back on the server that owns the requests'
    bookkeeping (whose subscription, what ended), its drain and adapters."""
    finished: Callable[[Request], None]              # a request ended: forget it
    fail: Callable[[str, str, ErrorKind], None]      # end it with an error its router hears
    abort_left: Callable[[], None]                   # the drain's deadline passed
    stop_drained: Callable[[], None]                 # drained and idle: stop serving
    reap_adapters: Callable[[], None]                # free unloaded adapters nothing runs under


class EngineLoop:
    """The passes of one engine server's loop thread, over the parts it
    drives (all used from this thread only)."""

    def __init__(self, name: str, role: Role, engine: Engine, planner: Planner, executor: Any,
                 transport: KvTransport | None, peer: PeerProtocol, inbox: Inbox, drain: Drain,
                 counts: EngineCounters, outputs: Outputs,
                 after_abort: dict[str, Callable[[], None]], hooks: LoopHooks):
        """`executor`: the server's (engine/executor/torch_executor.py), read for a
        request's logprobs; `after_abort`: the server's own dict of what to
        do once an abort that waited for its request's forward takes effect
        (engine.overlap): this loop runs and drops them."""
        self.name = name
        self.role = role
        self.engine = engine
        self.planner = planner
        self.executor = executor
        self.transport = transport
        self.peer = peer
        self.inbox = inbox
        self.drain = drain
        self.counts = counts
        self.outputs = outputs
        self.after_abort = after_abort
        self.hooks = hooks
        self.emitted: dict[str, int] = {}   # req -> tokens handed to the output thread
        # each round's features and time, as calibrate times them (plan, forward, apply)
        self.rounds: collections.deque = collections.deque(maxlen=ROUNDS_KEPT)
        self.errors: list[str] = []         # what `round failed` logged (tests assert none)
        self._window = next((g.window for g in planner.groups if g.sliding), 0)
        self._stalls_logged = 0
        self._stop = threading.Event()
        # what a pass reads the peer protocol's timers and the drain's deadline
        # by: a test moves it past a lease to play a thaw
        self.clock: Callable[[], float] = time.monotonic
        self._thread: threading.Thread | None = None
        # when (time.monotonic()) the loop thread last ended a pass; None
        # until it runs: what the watchdog reads (engine/watchdog.py)
        self.passed_at: float | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-loop",
                                        daemon=True)
        self.passed_at = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def failed(self, e: Exception) -> None:
        if len(self.errors) < ERRORS_KEPT:
            self.errors.append(f"{type(e).__name__}: {e}")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.tick():
                    self.hooks.stop_drained()
                    return
            except Exception as e:                   # keep serving; the log says what broke
                log.exception("%s: round failed", self.name)
                self.failed(e)
                time.sleep(0.05)
            self.passed_at = time.monotonic()

    def tick(self) -> bool:
        """One pass: transfer events, timers, jobs, a round. True when the
        engine drains and this pass was idle with nothing live: time to stop
        (a pass that did work is not idle; the next one decides)."""
        live = self.engine.has_work()
        busy = live and not self._only_waiting_on_peer()
        wait = 0 if busy else POLL_S if live or not self.peer.idle() else IDLE_WAIT_S
        ran = self.inbox.wait(wait)
        now = self.clock()
        if self.transport is not None:        # the clocks first: what ran out while we slept
            events = self.transport.poll()
            ran |= bool(events)
            for ev in events:
                self.peer.on_transfer_event(ev)
            self.peer.timers(now)
        ran |= self.inbox.run_pending()       # then the queue, less what its callers gave up on
        if self.drain.due(now):
            self.hooks.abort_left()
            ran = True
        if self.engine.has_work():
            ran = True
            self._round()
        self.hooks.reap_adapters()
        return self.drain.active and not ran and self.nothing_live()

    def nothing_live(self) -> bool:
        """No request in the engine, nothing outstanding with a peer."""
        return not self.engine.has_work() and self.peer.idle()

    def forget(self, req_id: str) -> None:
        """`req_id` has ended: nothing more of it goes to the output thread."""
        self.emitted.pop(req_id, None)

    def _round(self) -> None:
        start, t0, cpu0 = time.time(), time.perf_counter(), time.thread_time()
        out = self.engine.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        if out is not None:
            timed = round_of(out.plan, wall, self._window, start)
            if timed.computed:                # what a cost profile is held against
                self.rounds.append(timed)
            self.counts.round_done(wall, cpu,
                                   sum(n for _, n in timed.prefills) + timed.num_decodes)
        for msg in self.planner.stalls[self._stalls_logged:]:
            log.warning("%s: liveness last resort: %s", self.name, msg)
        self._stalls_logged = len(self.planner.stalls)
        if out is not None:
            self.after_round(out)

    def _only_waiting_on_peer(self) -> bool:
        p = self.planner
        return p.waiting_on_peer() and not (p.waiting or p.prefilling or p.running or p.retracted)

    def after_round(self, out) -> None:
        """A round's results: to the output thread, the counters and the peers."""
        plan = out.plan
        if out.error:
            kind = ErrorKind.INVALID if out.invalid else ErrorKind.FAILED
            if out.invalid:
                log.warning("%s: %d requests refused: %s", self.name, len(out.failed), out.error)
            else:
                log.error("%s: round %d failed: %s", self.name, plan.round, out.error)
            for req in out.failed:
                self.after_abort.pop(req.id, None)
                if self.role is Role.PREFILL:      # D hears it now and prefills itself
                    self.peer.give_up(req.id, out.error)
                    self.peer.release_twin(req.id)
                self.hooks.fail(req.id, out.error, kind)
            self.peer_work(plan)
            return
        c = self.counts
        c.retractions += len(plan.retracts)
        c.readmissions += len(plan.readmits)
        for op in plan.prefills:
            c.prefix_lookup(op.req.id, len(op.req.prompt.tokens), op.begin)
        for op in plan.remote_prefills:
            c.prefix_lookup(op.req.id, len(op.req.prompt.tokens),
                            op.first_page * self.planner.page_size)
        if self.role is not Role.PREFILL:
            finished, gone = set(out.finished), set(out.aborted)
            items = [self.output_item(op.req, op.req in finished) for op in plan.prefills
                     if op.completes and op.req not in gone]
            items += [self.output_item(req, req in finished) for req in plan.decodes
                      if req not in gone]
            self.outputs.post(items)
        for req in out.finished:
            self.hooks.finished(req)
        for req in out.aborted:                 # engine.overlap: aborts that waited for it
            then = self.after_abort.pop(req.id, None)
            if then is not None:
                then()
        self.peer_work(plan)

    def peer_work(self, plan) -> None:
        """The round's asks and ships, whether or not its forward ran: a
        remote admission's pages are reserved and a shipped prompt's KV was
        computed in an earlier round (left undone, each waited for a peer
        that was never asked, with no timeout)."""
        for op in plan.remote_prefills:
            if op.req.id in self.planner.landing:
                self.peer.ask_prefill(op)
        for op in plan.remote_decodes:
            if op.req.id in self.planner.transferring:
                self.peer.ship(op)

    def output_item(self, req, final: bool = False) -> OutputItem:
        """The tokens `req` produced since the last handoff, for the output
        thread; with `final`, its finish reason."""
        sent = self.emitted.get(req.id, 0)
        self.emitted[req.id] = len(req.output)
        t = self.executor.tracked.get(req.id)
        lps = ()
        if t is not None and t.logprobs:
            lps, t.logprobs = t.logprobs, []
        return OutputItem(req.id, req.output[sent:], lps,
                          (req.finish_reason or "length") if final else None,
                          sum(req.cached) if final else 0,
                          last_is_text=final and t is not None and t.grammar_done)
