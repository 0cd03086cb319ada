"""An engine as a service: the planner loop on its own thread, a gRPC
control server, and (for P and D) the NIXL transport and the peer protocol
(roles/peer_protocol.py: fences, leases, acks). A plain class;
cluster/actors.py makes it a Ray actor. Told to drain (roles/drain.py), it
takes no new request, finishes what it holds and stops by itself.

Threads: gRPC handlers never touch the planner. They put a closure on the
inbox; the loop thread runs it between rounds, so the planner, executor and
transport are only ever used from one thread. Results leave the loop thread
as one handoff a round to the output thread (roles/outputs.py), which
detokenizes them and batches them into one message a round for each router
subscribed (the Subscribe stream).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import queue
import socket
import threading
import time

import grpc

from pdserve.config import ServeConfig, engine_for_model
from pdserve.kernels.loader import load_model
from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg
from pdserve.proto.sampling import from_options
from pdserve.roles.drain import DEADLINE_ABORT, STOP_GRACE_S, Drain, EngineStopped
from pdserve.roles.engine_stats import EngineCounters, stats_pb
from pdserve.roles.engine_rpc import EngineControlServicer, StaleView
from pdserve.roles.rounds import Round, round_of
from pdserve.roles.engine import Engine
from pdserve.roles.outputs import Outputs
from pdserve.roles.peer_protocol import PeerProtocol
from pdserve.roles.torch_executor import TorchExecutor
from pdserve.scheduler.capacity import capacity_line, capacity_report
from pdserve.scheduler.grammar import Role
from pdserve.scheduler.planner import Planner, RejectedRequest
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer import Incarnation

log = logging.getLogger("pdserve.engine")

TRANSFER_TIMEOUT_S = 30.0
ROUNDS_KEPT = 20_000      # timed rounds kept for `take_rounds` (the oldest go first)
LEASE_S = 10.0
HEARTBEAT_S = 2.0
# how long a pass waits for a job: while requests or transfers are live, briefly
# (transfer events and timers are polled between waits); with nothing live, longer
# (a job still wakes it at once; only timers wait, at most this long)
POLL_S = 0.002
IDLE_WAIT_S = 0.02
# calls waiting for a handler thread: past gRPC's default of 1,000 it resets the
# newest (CANCELLED); routers hold their Submits to 128 each, peers send a few
PENDING_CALLS = [("grpc.server.max_pending_requests", 10_000),
                 ("grpc.server.max_pending_requests_hard_limit", 30_000)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineServer:
    def __init__(self, cfg: ServeConfig, role: str, index: int, host: str = "127.0.0.1",
                 device: str = "cpu", transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
                 lease_s: float = LEASE_S, heartbeat_s: float = HEARTBEAT_S,
                 faults: list[dict] | None = None, fault_seed: int = 0):
        self.role = Role(role)
        self.name = f"{role}-{index}"
        self.incarnation = time.time_ns()
        model, tok = load_model(cfg.model.path, cfg.model.preset, dtype=cfg.model.dtype,
                                device=device, attention=cfg.model.attention)
        engine_cfg = engine_for_model(cfg.engine, cfg.engine_overrides, model.cfg.max_position)
        self.tokenizer = tok
        self.executor = TorchExecutor(model, tok, engine_cfg, detokenize=False)
        self.planner = Planner(engine_cfg, self.role, groups=self.executor.groups)
        self.capacity = capacity_report(engine_cfg, self.planner.groups,
                                        self.executor.group_bytes())
        log.info("%s: %s", self.name, capacity_line(self.capacity))
        self.engine = Engine(self.name, self.planner, self.executor, forget_finished=False)
        transport = None
        if self.role is not Role.FUSED:
            from pdserve.transfer.nixl_transport import NixlTransport

            from pdserve.transfer.faults import FaultInjector

            transport = NixlTransport(Incarnation(self.name, self.incarnation),
                                      FaultInjector.from_config(faults or [], fault_seed))
            transport.register_pools(self.executor.transfer_pools())
        self.transport = transport
        self.peer = PeerProtocol(self, transport, transfer_timeout_s, lease_s, heartbeat_s)
        self.drain = Drain(self.name)
        self.owner: dict[str, str] = {}         # req -> the subscription its events go to
        self.emitted: dict[str, int] = {}       # req -> tokens handed to the output thread
        self.outputs = Outputs(tok, self._stop_string_hit, self.name)
        self.counts = EngineCounters()
        # each round's features and time, as calibrate times them (plan, forward, apply)
        self.rounds: collections.deque = collections.deque(maxlen=ROUNDS_KEPT)
        self._window = next((g.window for g in self.planner.groups if g.sliding), 0)
        self._inbox: queue.Queue = queue.Queue()
        self._inbox_lock = threading.Lock()     # closing the inbox against a racing put
        self._inbox_closed = False
        self._stop = threading.Event()
        self._shut = False
        self.loop_errors: list[str] = []        # what `round failed` logged (tests assert none)
        self._stalls_logged = 0
        self.server = grpc.server(cf.ThreadPoolExecutor(32, thread_name_prefix=self.name),
                                  options=PENDING_CALLS)
        pbg.add_EngineControlServicer_to_server(EngineControlServicer(self), self.server)
        port = self.server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{port}"
        self.server.start()
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-loop", daemon=True)
        self._thread.start()

    # ---- plumbing ------------------------------------------------------------
    def info(self) -> dict:
        return {"engine": self.name, "role": self.role.value, "incarnation": self.incarnation,
                "address": self.address,
                "dtype": str(self.executor.model.dtype).removeprefix("torch."),
                "attention": self.executor.model.attention.name,
                "kv_capacity_tokens": self.capacity["tokens"], "draining": self.drain.active}

    @property
    def counters(self) -> dict:
        return self.counts.as_dict()

    def call(self, fn, timeout: float = 30.0):
        """Run fn() on the loop thread and return its result; EngineStopped
        once the engine has drained and stopped."""
        fut: cf.Future = cf.Future()

        def job():
            try:
                fut.set_result(fn())
            except Exception as e:           # handed back to the caller
                fut.set_exception(e)
        if not self.post_job(job):
            raise EngineStopped(f"{self.name} has drained and stopped")
        return fut.result(timeout)

    def post_job(self, job) -> bool:
        """Queue `job` for the loop thread; False once the inbox is closed."""
        with self._inbox_lock:
            if self._inbox_closed:
                return False
            self._inbox.put(job)
            return True

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self._shut:
            return
        self._shut = True
        self.outputs.close()
        self.server.stop(grace=0.5)
        self.peer.close()

    # ---- drain -------------------------------------------------------------------
    def begin_drain(self, deadline_s: float) -> None:
        """Loop thread: take no new request from now on; stop once nothing
        is live, aborting what is left at the deadline."""
        self.drain.begin(time.monotonic(), deadline_s, len(self.planner.requests))
        log.info("%s: draining (%d requests live, deadline %.0f s)", self.name,
                 len(self.planner.requests), deadline_s)

    def _nothing_live(self) -> bool:
        return not self.engine.has_work() and self.peer.idle()

    def _abort_left(self) -> None:
        """The drain's deadline passed: end every live request with an error
        its client sees (a P twin not yet shipped: D is told, and prefills it
        itself)."""
        left = list(self.planner.requests)
        for rid in left:
            if self.role is Role.PREFILL:
                self.peer.give_up(rid, DEADLINE_ABORT)
            self.abort(rid, DEADLINE_ABORT)
        self.drain.aborted_left(len(left))
        log.warning("%s: drain deadline passed; aborted %d requests", self.name, len(left))

    def _stop_drained(self) -> None:
        """Loop thread, drained: close the inbox, flush every stream's last
        event to its router, answer the Drain RPC, then stop serving."""
        try:
            self.planner.check_invariants()
        except Exception as e:                       # reported; the stop goes on
            log.exception("%s: invariants broken at the drain's end", self.name)
            self.loop_errors.append(f"{type(e).__name__}: {e}")
        self.drain.finish(time.monotonic(), self.stats().used_pages)
        with self._inbox_lock:
            self._inbox_closed = True
        while True:              # calls that raced the close: new work is refused anyway
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                break
        self._shut = True
        self.outputs.close()
        self.drain.stopped.set()
        self.server.stop(grace=STOP_GRACE_S)
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
                    "landings": len(peer.landing), "counters": dict(self.counters),
                    "loop_errors": list(self.loop_errors),
                    "incarnation": self.incarnation}
        return self.call(run)

    def take_rounds(self) -> list[Round]:
        """The rounds that ran a forward since the last call (at most
        ROUNDS_KEPT): what `pdserve bench sim-accuracy` and `calibrate
        --served` hold a cost profile against."""
        out = []
        while self.rounds:
            out.append(self.rounds.popleft())
        return out

    def request_state(self, req_id: str) -> str | None:
        def run():
            r = self.planner.requests.get(req_id)
            return type(r.state).__name__ if r is not None else None
        return self.call(run)

    # ---- the loop --------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self._tick():
                    self._stop_drained()
                    return
            except Exception as e:                   # keep serving; the log says what broke
                log.exception("%s: round failed", self.name)
                if len(self.loop_errors) < 20:
                    self.loop_errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)

    def _tick(self) -> bool:
        """One pass: jobs, transfer events, timers, a round. True when the
        engine drains and this pass was idle with nothing live: time to stop
        (a pass that did work is not idle; the next one decides)."""
        live = self.engine.has_work()
        busy = live and not self._only_waiting_on_peer()
        ran = False
        try:
            wait = 0 if busy else POLL_S if live or not self.peer.idle() else IDLE_WAIT_S
            job = self._inbox.get(timeout=wait)
            ran = True
            job()
            while True:
                self._inbox.get_nowait()()
        except queue.Empty:
            pass
        now = time.monotonic()
        if self.transport is not None:
            events = self.transport.poll()
            ran |= bool(events)
            for ev in events:
                self.peer.on_transfer_event(ev)
            self.peer.timers(now)
        if self.drain.due(now):
            self._abort_left()
            ran = True
        if self.engine.has_work():
            ran = True
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
                self._after_round(out)
        return self.drain.active and not ran and self._nothing_live()

    def _only_waiting_on_peer(self) -> bool:
        p = self.planner
        return p.waiting_on_peer() and not (p.waiting or p.prefilling or p.running or p.retracted)

    def _after_round(self, out) -> None:
        plan = out.plan
        if out.error:
            log.error("%s: round %d failed: %s", self.name, plan.round, out.error)
            for req in out.failed:
                if self.role is Role.PREFILL:      # D hears it now and prefills itself
                    self.peer.give_up(req.id, out.error)
                    self.peer.release_twin(req.id)
                self._fail(req.id, out.error)
            self._peer_work(plan)
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
            finished = set(out.finished)
            items = [self.output_item(op.req, op.req in finished) for op in plan.prefills
                     if op.completes]
            items += [self.output_item(req, req in finished) for req in plan.decodes]
            self.outputs.post(items)
        for req in out.finished:
            self.request_finished(req)
        self._peer_work(plan)

    def _peer_work(self, plan) -> None:
        """The round's asks and ships, whether or not its forward ran: a
        remote admission's pages are reserved and a shipped prompt's KV was
        computed in an earlier round (left undone, each waited for a peer
        that was never asked, with no timeout)."""
        p = self.planner
        for op in plan.remote_prefills:
            if op.req.id in p.landing:
                self.peer.ask_prefill(op)
        for op in plan.remote_decodes:
            if op.req.id in p.transferring:
                self.peer.ship(op)

    # ---- outputs ---------------------------------------------------------------
    def output_item(self, req, final: bool = False) -> tuple:
        """The tokens `req` produced since the last handoff, for the output
        thread; with `final`, its finish reason."""
        sent = self.emitted.get(req.id, 0)
        self.emitted[req.id] = len(req.output)
        t = self.executor.tracked.get(req.id)
        lps = ()
        if t is not None and t.logprobs:
            lps, t.logprobs = t.logprobs, []
        return (req.id, req.output[sent:], lps, (req.finish_reason or "length") if final else None,
                None)

    def request_finished(self, req) -> None:
        self.counts.finished += 1
        self._close(req.id)

    def _close(self, req_id: str) -> None:
        self.owner.pop(req_id, None)
        self.emitted.pop(req_id, None)
        self.counts.forget(req_id)
        self.executor.forget(req_id)

    def _fail(self, req_id: str, error: str) -> None:
        if req_id in self.owner:
            self.outputs.post([(req_id, (), (), None, error)])
        self._close(req_id)

    def _stop_string_hit(self, req_id: str, req) -> None:
        """Output thread: `req` (the Request submitted as `req_id`) produced a
        stop string; its last event is out. The loop lets it go, unless it
        finished meanwhile: a new request under the same id is not it."""
        def release():
            if self.planner.requests.get(req_id) is req and req_id in self.owner:
                self.planner.abort(req_id, "stop string")
                self.counts.finished += 1
                self._close(req_id)
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
        req = Request(r.request_id, list(r.token_ids), SamplingLimits(max_new_tokens=sp.max_tokens))
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

    def abort(self, req_id: str, reason: str) -> bool:
        p = self.planner
        req = p.requests.get(req_id)
        if req is None:
            return False
        if req_id in p.landing:
            self.peer.abort_landing(req, reason)
        p.abort(req_id, reason)
        self.counts.aborted += 1
        if self.role is Role.PREFILL:
            self.peer.release_twin(req_id)
        self._fail(req_id, f"aborted: {reason}")
        return True

    # ---- stats -----------------------------------------------------------------
    def stats(self) -> pb.EngineStatsResponse:
        info = self.info()
        return stats_pb(self.planner, self.role, self.counts, self.capacity, info["dtype"],
                        info["attention"])
