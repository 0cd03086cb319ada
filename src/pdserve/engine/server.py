"""An engine as a service: the planner loop on its own thread
(engine/loop.py), a gRPC control server, and (for P and D) the KV transport
and the peer protocol (engine/peer/protocol.py: fences, leases, acks). A
plain class built from its parts (planner, executor, outputs, transport);
cluster/actors.py wires them from a deployment's config and makes it a Ray
actor. Told to drain (engine/drain.py), it takes no new request, finishes
what it holds and stops by itself.

Threads: gRPC handlers never touch the planner. They put a closure on the
inbox; the loop thread runs it between rounds, so the planner, executor and
transport are only ever used from one thread. Results leave the loop thread
as one handoff a round to the output thread (engine/outputs.py), which
detokenizes them and batches them into one message a round for each router
subscribed (the Subscribe stream).

Constructed, it serves nothing: `start(host)` opens the gRPC port and starts
the loop thread (tests drive the loop's passes themselves instead).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Callable

import grpc

from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg
from pdserve.proto.control_tls import ControlTls, add_port
from pdserve.proto.sampling import from_options
from pdserve.engine.control_checks import Bounds
from pdserve.engine.drain import DEADLINE_ABORT, STOP_GRACE_S, Drain, EngineStopped
from pdserve.engine.engine import Engine
from pdserve.engine.rpc import CALL_TIMEOUT_S, EngineControlServicer, StaleView
from pdserve.engine.spec.speculation import spec_line
from pdserve.engine.stats import EngineCounters, expert_tokens, stats_pb
from pdserve.engine.loop import EngineLoop, Inbox, LoopHooks
from pdserve.engine.outputs import ErrorKind, Outputs, StreamError
from pdserve.engine.peer.messages import PeerSender
from pdserve.engine.peer.protocol import PeerProtocol, PeerTimeouts
from pdserve.engine.watchdog import Watchdog, WatchdogLimits
from pdserve.proto.keepalive import server_options
from pdserve.engine.rounds import Round
from pdserve.scheduler.round.grammar import Role
from pdserve.engine.lora.adapters import adapter_of, adapters_in_use
from pdserve.scheduler.planner import Planner, RejectedRequest
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer import Incarnation

log = logging.getLogger("pdserve.engine")

# calls waiting for a handler thread: past gRPC's default of 1,000 it resets the
# newest (CANCELLED); routers hold their Submits to 128 each, peers send a few
PENDING_CALLS = [("grpc.server.max_pending_requests", 10_000),
                 ("grpc.server.max_pending_requests_hard_limit", 30_000)]
HANDLER_THREADS = 32

# (request id, the Request it was found for): the output thread found a stop string
StopHandler = Callable[[str, object], None]


class EngineServer:
    def __init__(self, role: Role, name: str, planner: Planner, executor,
                 make_outputs: Callable[[StopHandler], Outputs], transport=None, *,
                 incarnation: int, capacity: dict | None = None,
                 timeouts: PeerTimeouts = PeerTimeouts(), sender: PeerSender | None = None,
                 control_tls: ControlTls | None = None, vocab_size: int | None = None,
                 on_stuck: Callable[[str], None] | None = None):
        """`executor`: runs a plan (engine/executor/torch_executor.py); `make_outputs`:
        builds the output thread's end, given what it calls on a stop string;
        `transport`: the KvTransport of a P or D (None on a fused engine), of
        this `incarnation`; `capacity`: the KV capacity report the engine's
        stats carry; `sender`: how peer messages leave (a thread pool);
        `control_tls`: this engine's credentials on the control plane (its
        port and its channels to peers; None: plaintext, anyone may call);
        `vocab_size`: token ids a message may carry are below it;
        `on_stuck(why)`: what the engine does once its loop or output thread
        has been stuck past engine.stuck_loop_restart_s (engine/watchdog.py;
        a deployment's exits the process for Ray to restart; None: logs)."""
        self.role = role
        self.name = name
        self.incarnation = incarnation
        self.planner = planner
        self.executor = executor
        self.capacity = capacity or {"tokens": 0, "groups": []}   # none given: unknown
        self.engine = Engine(name, planner, executor, forget_finished=False)
        self.transport = transport
        self.control_tls = control_tls
        self.bounds = Bounds(vocab_size=vocab_size,
                             max_prompt_tokens=planner.cfg.max_context_tokens,
                             pages=transport.num_pages if transport is not None
                             else planner.cfg.total_pages,
                             page_size=planner.cfg.page_size)
        self.drain = Drain(name)
        self.counts = EngineCounters()
        self.owner: dict[str, str] = {}         # req -> the subscription its events go to
        # engine.overlap: what to do once an abort that waited for its
        # request's forward takes effect (EngineLoop.after_round runs it)
        self.after_abort: dict[str, Callable[[], None]] = {}
        self.outputs = make_outputs(self._stop_string_hit)
        self.inbox = Inbox(on_stale=self.counts.job_dropped)
        self.peer = PeerProtocol(Incarnation(name, incarnation), role, planner, executor,
                                 self.counts, self.drain, transport,
                                 sender or PeerSender(name), timeouts,
                                 post_job=self.post_job, delivered=self._delivered,
                                 control_tls=control_tls)
        self.loop = EngineLoop(name, role, self.engine, planner, executor, transport, self.peer,
                               self.inbox, self.drain, self.counts, self.outputs,
                               self.after_abort,
                               LoopHooks(finished=self.request_finished, fail=self.fail,
                                         abort_left=self.abort_left,
                                         stop_drained=self.stop_drained,
                                         reap_adapters=self.reap_adapters))
        self.watchdog = Watchdog(name, WatchdogLimits(planner.cfg.stall_unhealthy_s,
                                                      planner.cfg.stuck_loop_restart_s),
                                 lambda: self.loop.passed_at,
                                 lambda: self.outputs.busy_since, on_stuck)
        self.address = ""                       # host:port, once started
        self.metadata = b""                     # the transport's, for peers: read once started
        self._server: grpc.Server | None = None
        self._shut = False

    def start(self, host: str = "127.0.0.1") -> None:
        """Serve: the gRPC control server on a free port of `host` (mutual
        TLS with this engine's `control_tls`), and the loop thread."""
        # what GetInfo hands peers, read here so that the answer never waits
        # for the loop thread (the transport is the loop's once it runs)
        self.metadata = self.transport.metadata() if self.transport is not None else b""
        self._server = grpc.server(cf.ThreadPoolExecutor(HANDLER_THREADS,
                                                         thread_name_prefix=self.name),
                                   options=server_options(PENDING_CALLS))
        pbg.add_EngineControlServicer_to_server(EngineControlServicer(self), self._server)
        port = add_port(self._server, f"{host}:0", self.control_tls)
        self.address = f"{host}:{port}"
        self._server.start()
        self.loop.start()
        self.watchdog.start()

    # ---- plumbing ------------------------------------------------------------
    def info(self) -> dict:
        return {"engine": self.name, "role": self.role.value, "incarnation": self.incarnation,
                "address": self.address,
                "dtype": str(self.executor.model.dtype).removeprefix("torch."),
                "attention": self.executor.model.attention.name,
                "kv_capacity_tokens": self.capacity["tokens"], "draining": self.drain.active,
                "adapters": [f"{r.name}:{r.id}" for r in self.executor.adapters.refs()]
                if self.executor.adapters is not None else [],
                "spec_config": spec_line(self.planner.cfg)}

    @property
    def counters(self) -> dict:
        return self.counts.as_dict()

    def call(self, fn, timeout: float = CALL_TIMEOUT_S):
        """Run fn() on the loop thread and return its result, waiting at
        most `timeout` seconds (TimeoutError); EngineStopped once the engine
        has drained and stopped. Past `timeout` the caller has given up, so
        the job is dropped unrun if the loop has not reached it: work nobody
        waits for any more (a RemotePrefill its D stopped waiting for, a
        heartbeat that would renew an expired lease) is not done late."""
        fut: cf.Future = cf.Future()

        def job():
            if not fut.set_running_or_notify_cancel():
                return                       # the caller gave up as the loop reached it
            try:
                fut.set_result(fn())
            except Exception as e:           # handed back to the caller
                fut.set_exception(e)
        def dropped():                       # tell the caller at once, not at its timeout
            if fut.set_running_or_notify_cancel():
                fut.set_exception(cf.TimeoutError(f"{self.name}'s loop did not reach the call "
                                                  "before its caller's deadline"))
        if not self.inbox.post(job, self.inbox.clock() + timeout, dropped):
            raise EngineStopped(f"{self.name} has drained and stopped")
        try:
            return fut.result(timeout)
        except cf.TimeoutError:
            fut.cancel()
            raise

    def post_job(self, job, deadline: float | None = None) -> bool:
        """Queue `job` for the loop thread (dropped unrun once `deadline`,
        time.monotonic(), passes); False once the inbox is closed."""
        return self.inbox.post(job, deadline)

    def shutdown(self) -> None:
        self.watchdog.stop()
        self.loop.stop()
        if self._shut:
            return
        self._shut = True
        close = getattr(self.executor, "close", None)
        if close is not None:               # the forward thread of a round that ran ahead
            close()
        self.outputs.close()
        if self._server is not None:
            self._server.stop(grace=0.5)
        self.peer.close()

    # ---- drain -------------------------------------------------------------------
    def begin_drain(self, deadline_s: float) -> None:
        """Loop thread: take no new request from now on; stop once nothing
        is live, aborting what is left at the deadline."""
        self.drain.begin(time.monotonic(), deadline_s, len(self.planner.requests))
        log.info("%s: draining (%d requests live, deadline %.0f s)", self.name,
                 len(self.planner.requests), deadline_s)

    def nothing_live(self) -> bool:
        return self.loop.nothing_live()

    def abort_left(self) -> None:
        """Loop thread: the drain's deadline passed: end every live request
        with an error its client sees, and its router reads as the server
        going away (a P twin not yet shipped: D is told, and prefills it
        itself)."""
        left = list(self.planner.requests)
        for rid in left:
            if self.role is Role.PREFILL:
                self.peer.give_up(rid, DEADLINE_ABORT)
            self.abort(rid, DEADLINE_ABORT, ErrorKind.DEADLINE)
        self.drain.aborted_left(len(left))
        log.warning("%s: drain deadline passed; aborted %d requests", self.name, len(left))

    def stop_drained(self) -> None:
        """Loop thread, drained: close the inbox, flush every stream's last
        event to its router, answer the Drain RPC, then stop serving."""
        try:
            self.planner.check_invariants()
        except Exception as e:                       # reported; the stop goes on
            log.exception("%s: invariants broken at the drain's end", self.name)
            self.loop.errors.append(f"{type(e).__name__}: {e}")
        self.watchdog.stop()                         # the loop thread ends here
        self.drain.finish(time.monotonic(), self.stats().used_pages)
        self.inbox.close()
        self.inbox.run_pending()    # calls that raced the close: new work is refused anyway
        self._shut = True
        self.outputs.close()
        self.drain.stopped.set()
        if self._server is not None:
            self._server.stop(grace=STOP_GRACE_S)
        self.peer.stopped()          # D may free what it held for this P's writes
        self.peer.close(wait=True)
        log.info("%s: drained and stopped: %s", self.name, self.drain.report)

    # ---- test and operator hooks ------------------------------------------------
    def set_faults(self, rules: list[dict], seed: int = 0) -> None:
        """Replace this engine's transfer fault rules (see transfer/faults.py)."""
        from pdserve.transfer.faults import FaultInjector

        def apply():
            if self.transport is not None:
                self.transport.faults = FaultInjector.from_config(rules, seed)
        self.call(apply)

    def check(self) -> dict:
        """Invariants, and whether the engine is idle (nothing live, no page
        held, pinned or fenced, no lease or landing outstanding)."""
        def run():
            p = self.planner
            p.check_invariants()
            stats = self.stats()
            peer = self.peer
            idle = (not p.requests and stats.used_pages == 0 and not p.coord.fences
                    and peer.idle() and len(peer.landing) == 0)
            fired: dict[str, int] = {}
            if self.transport is not None:
                for stage, action, _ in self.transport.faults.fired:
                    fired[f"{stage}:{action}"] = fired.get(f"{stage}:{action}", 0) + 1
            return {"idle": idle, "requests": sorted(p.requests), "used_pages": stats.used_pages,
                    "faults_fired": fired,
                    "fences": len(p.coord.fences), "leases": len(peer.leases),
                    "quarantined": len(peer.quarantined()),
                    "landings": len(peer.landing), "counters": dict(self.counters),
                    "loop_errors": list(self.loop.errors),
                    "incarnation": self.incarnation}
        return self.call(run)

    def take_rounds(self) -> list[Round]:
        """The rounds that ran a forward since the last call (at most
        ROUNDS_KEPT): what `pdserve bench sim-accuracy` and `calibrate
        --served` hold a cost profile against."""
        rounds, out = self.loop.rounds, []
        while rounds:
            out.append(rounds.popleft())
        return out

    def request_state(self, req_id: str) -> str | None:
        def run():
            r = self.planner.requests.get(req_id)
            return type(r.state).__name__ if r is not None else None
        return self.call(run)

    # ---- the requests' ends (loop thread) ---------------------------------------
    def _delivered(self, req, finished) -> None:
        """A D's landed request has its first token (from P): out it goes,
        with the requests that ended with it."""
        self.outputs.post([self.loop.output_item(req, bool(finished))])
        for r in finished:
            self.request_finished(r)

    def request_finished(self, req) -> None:
        self.after_abort.pop(req.id, None)      # it finished before a deferred abort could
        self.counts.finished += 1
        self._close(req.id)

    def _close(self, req_id: str) -> None:
        self.owner.pop(req_id, None)
        self.loop.forget(req_id)
        self.counts.forget(req_id)
        self.executor.forget(req_id)

    def fail(self, req_id: str, error: str, kind: ErrorKind) -> None:
        """End `req_id` with `error`, its router's stream told (if it has one)."""
        if req_id in self.owner:
            self.outputs.post([StreamError(req_id, error, kind)])
        self._close(req_id)

    def _stop_string_hit(self, req_id: str, req) -> None:
        """Output thread: `req` (the Request submitted as `req_id`) produced a
        stop string; its last event is out. The loop lets it go, unless it
        finished meanwhile: a new request under the same id is not it."""
        def released():
            self.counts.finished += 1
            self._close(req_id)

        def release():
            if self.planner.requests.get(req_id) is req and req_id in self.owner:
                if self.engine.abort(req_id, "stop string") is None:
                    self.after_abort[req_id] = released    # after its forward in flight
                else:
                    released()
        self.post_job(release)

    def subscriber_gone(self, subscriber: str) -> None:
        """A router's subscription ended: abort the requests it submitted."""
        def run():
            for rid in [r for r, s in self.owner.items() if s == subscriber]:
                self.abort(rid, "router went away")
        self.post_job(run)

    # ---- submit and abort (router) ---------------------------------------------
    def submit(self, r: pb.SubmitRequest) -> None:
        """Loop thread: admit a request; its events go to `r.subscriber`."""
        if self.role is Role.PREFILL:
            raise RejectedRequest(f"{self.name} is a prefill engine: submit to a decode or "
                                  "fused engine")
        self.drain.refuse("request")
        try:
            sp = from_options(r.sampling)
        except ValueError as e:
            raise RejectedRequest(str(e)) from None
        if r.prior_output > len(r.token_ids):
            raise RejectedRequest(f"prior_output={r.prior_output} exceeds the request's "
                                  f"{len(r.token_ids)} tokens")
        if not self.outputs.has(r.subscriber):
            raise StaleView(f"{self.name} has no subscription {r.subscriber!r}: "
                            "subscribe first, then submit")
        if r.request_id in self.planner.requests or r.request_id in self.owner:
            raise RejectedRequest(f"request id {r.request_id!r} is live on {self.name}; "
                                  "use a fresh id")
        adapter = adapter_of(self.executor.adapters, self.name, r.adapter, r.adapter_id)
        req = Request(r.request_id, list(r.token_ids),
                      SamplingLimits(max_new_tokens=sp.max_tokens), adapter=adapter)
        if r.prefill_peer and self.role is Role.DECODE:
            if r.prefill_peer not in self.peer.peers:
                raise StaleView(f"{self.name} does not know prefill engine "
                                f"{r.prefill_peer!r}")
            req.peer = r.prefill_peer
        self.executor.register(req.id, sp, fallback_seed=hash(req.id) & 0xFFFFFFF,
                               prompt=req.prompt.tokens, prior_output=r.prior_output)
        try:
            self.planner.submit(req)
        except RejectedRequest:
            self.executor.forget(req.id)
            raise
        self.owner[req.id] = r.subscriber
        self.outputs.open(req.id, r.subscriber, req.prompt.tokens, sp, key=req,
                          prior=(r.prior_output, r.prior_text_chars))

    # ---- LoRA adapters at runtime (router) --------------------------------------
    def _lora(self):
        if self.executor.adapters is None:
            raise RejectedRequest(f"{self.name} serves no LoRA adapters (no lora section in "
                                  "its config); adapters cannot be loaded at runtime there")
        return self.executor.adapters

    def load_adapter(self, name: str, path: str, adapter_id: int, weights,
                     pinned: bool = False, stamp: tuple | None = None) -> None:
        """Loop thread: hold `weights` (read off the loop; `stamp`: its files'
        fingerprint before the read) as load `adapter_id` of `name`."""
        self._lora().load(name, path, adapter_id, weights, pinned, stamp)
        self.reap_adapters()          # a load it replaced may have no request left

    def unload_adapter(self, name: str, adapter_id: int):
        """Loop thread: stop taking requests under the load; an event set once
        the last one under it has ended."""
        try:
            done = self._lora().unload(name, adapter_id)
        except KeyError as e:
            raise RejectedRequest(e.args[0]) from None
        self.reap_adapters()
        return done

    def reap_adapters(self) -> None:
        """Loop thread, each pass: free unloaded adapters nothing runs under."""
        a = self.executor.adapters
        if a is not None and a.unloading:
            a.reap({r.adapter for r in self.planner.requests.values()}, self.planner.lora)

    def abort(self, req_id: str, reason: str, kind: ErrorKind = ErrorKind.ABORTED) -> bool:
        p = self.planner
        req = p.requests.get(req_id)
        if req is None:
            return False
        if req_id in p.landing:
            self.peer.abort_landing(req, reason)
        if self.role is Role.PREFILL and self.peer.writing(req_id):
            # its write may still read the pages: they go when it ends
            self.counts.aborted += 1
            self.peer.abort_twin(req_id)
            self.fail(req_id, f"aborted: {reason}", kind)
            return True

        def aborted():
            self.counts.aborted += 1
            if self.role is Role.PREFILL:
                self.peer.release_twin(req_id)
            self.fail(req_id, f"aborted: {reason}", kind)
        if self.engine.abort(req_id, reason) is None:
            self.after_abort[req_id] = aborted     # engine.overlap: once its forward lands
        else:
            aborted()
        return True

    # ---- stats -----------------------------------------------------------------
    def stats(self) -> pb.EngineStatsResponse:
        info = self.info()
        disk = getattr(self.executor, "disk", None)
        return stats_pb(self.planner, self.role, self.counts, self.capacity, info["dtype"],
                        info["attention"], disk.stats() if disk is not None else None,
                        adapters_in_use(self.executor.adapters, self.planner),
                        getattr(self.executor, "spec", None),
                        tuple((ld.req_id, ld.epoch) for ld in self.peer.quarantined()),
                        expert_tokens(self.executor.model))
