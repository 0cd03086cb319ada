"""An engine as a service: the planner loop on its own thread, a gRPC
control server, and (for P and D) the NIXL transport with its fences and
leases. A plain class; cluster/actors.py makes it a Ray actor.

Threads: gRPC handlers never touch the planner. They put a closure on the
inbox; the loop thread runs it between rounds, so the planner, executor and
transport are only ever used from one thread. Results leave the loop thread
as one handoff a round to the output thread (roles/outputs.py), which
detokenizes them and batches them into one message a round for each router
subscribed (the Subscribe stream).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import queue
import socket
import threading
import time

import grpc

from pdserve.cluster.config import ServeConfig, engine_for_model
from pdserve.kernels.loader import load_model
from pdserve.kernels.sampling import Logprob, SamplingParams
from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg
from pdserve.proto import router_pb2 as rpb
from pdserve.roles.engine_stats import EngineCounters, waiting_requests_pb
from pdserve.roles.engine_rpc import EngineControlServicer
from pdserve.roles.engine import Engine
from pdserve.roles.outputs import Outputs, logprob_pb
from pdserve.roles.torch_executor import TorchExecutor
from pdserve.scheduler.capacity import capacity_line, capacity_report
from pdserve.scheduler.grammar import Role
from pdserve.scheduler.planner import Planner, RejectedRequest
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer import Incarnation, KvWrite, LandingTable, LeaseTable

log = logging.getLogger("pdserve.engine")

TRANSFER_TIMEOUT_S = 30.0
LEASE_S = 10.0
HEARTBEAT_S = 2.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Peer:
    name: str
    incarnation: int
    address: str
    stub: object


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
                                        [c.data[0].nbytes for c in self.executor.caches])
        log.info("%s: %s", self.name, capacity_line(self.capacity))
        self.engine = Engine(self.name, self.planner, self.executor, forget_finished=False)
        self.transport = None
        if self.role is not Role.FUSED:
            from pdserve.transfer.nixl_transport import NixlTransport

            from pdserve.transfer.faults import FaultInjector

            self.transport = NixlTransport(Incarnation(self.name, self.incarnation),
                                           FaultInjector.from_config(faults or [], fault_seed))
            self.transport.register_pools([c.data for c in self.executor.caches])
        self.landing = LandingTable(transfer_timeout_s, lease_s)     # D
        self.leases = LeaseTable(lease_s)                             # P
        self.heartbeat_s = heartbeat_s
        self.peers: dict[str, Peer] = {}
        self.remote: dict[str, tuple] = {}      # P: req -> (D name, incarnation, pages, epoch)
        self.epochs: dict[str, int] = {}        # D: req -> landing epoch
        self.owner: dict[str, str] = {}         # req -> the subscription its events go to
        self.emitted: dict[str, int] = {}       # req -> tokens handed to the output thread
        self.outputs = Outputs(tok, self._stop_string_hit, self.name)
        self.counts = EngineCounters()
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._rpc_pool = cf.ThreadPoolExecutor(8, thread_name_prefix=f"{self.name}-rpc")
        self.loop_errors: list[str] = []        # what `round failed` logged (tests assert none)
        self._last_heartbeat = 0.0
        self._stalls_logged = 0
        self.server = grpc.server(cf.ThreadPoolExecutor(32, thread_name_prefix=self.name))
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
                "kv_capacity_tokens": self.capacity["tokens"]}

    @property
    def counters(self) -> dict:
        return self.counts.as_dict()

    def call(self, fn, timeout: float = 30.0):
        """Run fn() on the loop thread and return its result."""
        fut: cf.Future = cf.Future()

        def job():
            try:
                fut.set_result(fn())
            except Exception as e:           # handed back to the caller
                fut.set_exception(e)
        self._inbox.put(job)
        return fut.result(timeout)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.outputs.close()
        self.server.stop(grace=0.5)
        self._rpc_pool.shutdown(wait=False, cancel_futures=True)
        if self.transport is not None:
            self.transport.close()

    def _send(self, peer_name: str, method: str, request) -> None:
        """Fire a control message to a peer off the loop thread. An "ack"
        fault rule can drop or delay a TransferAck (chaos tests)."""
        peer = self.peers.get(peer_name)
        if peer is None:
            log.warning("%s: no peer %s for %s", self.name, peer_name, method)
            return
        delay = 0.0
        if method == "TransferAck" and self.transport is not None:
            rule = self.transport.faults.match("ack", request.request_id)
            if rule is not None and rule.action in ("drop", "fail"):
                return
            if rule is not None and rule.action == "delay":
                delay = rule.delay_s

        def go():
            try:
                getattr(peer.stub, method)(request, timeout=10)
            except grpc.RpcError as e:
                log.warning("%s -> %s %s failed: %s", self.name, peer_name, method, e.code())
        if delay:
            threading.Timer(delay, lambda: self._rpc_pool.submit(go)).start()
        else:
            self._rpc_pool.submit(go)

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
            idle = (not p.requests and stats.used_pages == 0 and not p.coord.fences
                    and len(self.leases) == 0 and len(self.landing) == 0 and not self.remote)
            fired: dict[str, int] = {}
            if self.transport is not None:
                for stage, action, _ in self.transport.faults.fired:
                    fired[f"{stage}:{action}"] = fired.get(f"{stage}:{action}", 0) + 1
            return {"idle": idle, "requests": sorted(p.requests), "used_pages": stats.used_pages,
                    "faults_fired": fired,
                    "fences": len(p.coord.fences), "leases": len(self.leases),
                    "landings": len(self.landing), "counters": dict(self.counters),
                    "loop_errors": list(self.loop_errors),
                    "incarnation": self.incarnation}
        return self.call(run)

    def request_state(self, req_id: str) -> str | None:
        def run():
            r = self.planner.requests.get(req_id)
            return type(r.state).__name__ if r is not None else None
        return self.call(run)

    # ---- the loop --------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception as e:                   # keep serving; the log says what broke
                log.exception("%s: round failed", self.name)
                if len(self.loop_errors) < 20:
                    self.loop_errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)

    def _tick(self) -> None:
        busy = self.engine.has_work() and not self._only_waiting_on_peer()
        try:
            job = self._inbox.get(timeout=0 if busy else 0.002)
            job()
            while True:
                self._inbox.get_nowait()()
        except queue.Empty:
            pass
        now = time.monotonic()
        if self.transport is not None:
            for ev in self.transport.poll():
                self._on_transfer_event(ev)
            self._timers(now)
        if self.engine.has_work():
            out = self.engine.step()
            for msg in self.planner.stalls[self._stalls_logged:]:
                log.warning("%s: liveness last resort: %s", self.name, msg)
            self._stalls_logged = len(self.planner.stalls)
            if out is not None:
                self._after_round(out)

    def _only_waiting_on_peer(self) -> bool:
        p = self.planner
        return p.waiting_on_peer() and not (p.waiting or p.prefilling or p.running or p.retracted)

    def _after_round(self, out) -> None:
        plan = out.plan
        if out.error:
            log.error("%s: round %d failed: %s", self.name, plan.round, out.error)
            for req in out.failed:
                self._fail(req.id, out.error)
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
            items = [self._item(op.req, op.req in finished) for op in plan.prefills
                     if op.completes]
            items += [self._item(req, req in finished) for req in plan.decodes]
            self.outputs.post(items)
        for req in out.finished:
            self._finished(req)
        for op in plan.remote_prefills:
            self._ask_prefill(op)
        for op in plan.remote_decodes:
            self._ship(op)

    # ---- outputs ---------------------------------------------------------------
    def _item(self, req, final: bool = False) -> tuple:
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

    def _finished(self, req) -> None:
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

    def _stop_string_hit(self, req_id: str) -> None:
        """Output thread: `req_id` produced a stop string; its last event is
        out. The loop lets the request go (it may have finished meanwhile)."""
        def release():
            if req_id in self.planner.requests and req_id in self.owner:
                self.planner.abort(req_id, "stop string")
                self.counts.finished += 1
                self._close(req_id)
        self._inbox.put(release)

    def subscriber_gone(self, subscriber: str) -> None:
        """A router's subscription ended: abort the requests it submitted."""
        def run():
            for rid in [r for r, s in self.owner.items() if s == subscriber]:
                self.abort(rid, "router went away")
        self._inbox.put(run)

    # ---- submit and abort (router) ---------------------------------------------
    def submit(self, r: pb.SubmitRequest) -> None:
        """Loop thread: admit a request; its events go to `r.subscriber`."""
        sp = SamplingParams(max_tokens=r.max_tokens if r.HasField("max_tokens") else None,
                            temperature=r.temperature, top_p=r.top_p or 1.0, top_k=r.top_k,
                            seed=r.seed if r.HasField("seed") else None, stop=tuple(r.stop),
                            stop_token_ids=tuple(r.stop_token_ids), ignore_eos=r.ignore_eos,
                            min_tokens=r.min_tokens,
                            logprobs=r.logprobs if r.HasField("logprobs") else None)
        if not self.outputs.has(r.subscriber):
            raise RejectedRequest(f"{self.name} has no subscription {r.subscriber!r}: "
                                  "subscribe first, then submit")
        if r.request_id in self.planner.requests or r.request_id in self.owner:
            raise RejectedRequest(f"request id {r.request_id!r} is live on {self.name}; "
                                  "use a fresh id")
        req = Request(r.request_id, list(r.token_ids), SamplingLimits(max_new_tokens=sp.max_tokens))
        if r.prefill_peer and self.role is Role.DECODE:
            if r.prefill_peer not in self.peers:
                raise RejectedRequest(f"{self.name} does not know prefill engine "
                                      f"{r.prefill_peer!r}")
            req.peer = r.prefill_peer
        self.executor.register(req.id, sp, fallback_seed=hash(req.id) & 0xFFFFFFF,
                               prompt=req.prompt.tokens)
        try:
            self.planner.submit(req)
        except RejectedRequest:
            self.executor.forget(req.id)
            raise
        self.owner[req.id] = r.subscriber
        self.outputs.open(req.id, r.subscriber, req.prompt.tokens, sp.stop, sp.min_tokens)

    def abort(self, req_id: str, reason: str) -> bool:
        p = self.planner
        req = p.requests.get(req_id)
        if req is None:
            return False
        if req_id in p.landing:
            # a posted write may still land: fence the pages, then let go
            epoch = self.epochs.pop(req_id, None)
            fenced = epoch is not None and \
                self.landing.fence(req_id, epoch, time.monotonic()) is not None
            self.counts.fences += fenced
            p.transfer_failed(req_id, reason, fence_key=(req_id, epoch) if fenced else None)
            self._send(req.peer, "TransferAck", pb.TransferAckRequest(request_id=req_id,
                                                                      release_only=True))
        p.abort(req_id, reason)
        self.counts.aborted += 1
        if self.role is Role.PREFILL:
            self.leases.release(req_id)
            self.remote.pop(req_id, None)
            self.transport.cancel(req_id)
        self._fail(req_id, f"aborted: {reason}")
        return True

    # ---- D: asking P, and what comes back --------------------------------------
    def _ask_prefill(self, op) -> None:
        req = op.req
        if req.peer is None or req.peer not in self.peers:
            self._recover_locally(req.id, 0, "no prefill peer", fence=False, stage="no_peer")
            return
        landing = self.transport.page_ids(op.landing)      # every group's, one list
        epoch = self.landing.expect(req.id, landing, time.monotonic())
        self.epochs[req.id] = epoch
        sp = self.executor.params(req.id)
        self._send(req.peer, "RemotePrefill", pb.RemotePrefillRequest(
            request_id=req.id, token_ids=req.prompt.tokens, first_page=op.first_page,
            landing_pages=landing, epoch=epoch, target_engine=self.name,
            target_incarnation=self.incarnation, temperature=sp.temperature,
            top_p=sp.top_p, top_k=sp.top_k, **({"seed": sp.seed} if sp.seed is not None else {}),
            **({"logprobs": sp.logprobs} if sp.logprobs is not None else {})))

    def _recover_locally(self, req_id: str, epoch: int, reason: str, fence: bool,
                         stage: str) -> None:
        if req_id not in self.planner.landing:
            return
        key = None
        if fence:
            self.counts.fences += self.landing.fence(req_id, epoch, time.monotonic()) is not None
            key = (req_id, epoch)
        self.epochs.pop(req_id, None)
        self.counts.transfer_failed(stage)
        self.planner.transfer_failed(req_id, reason, fence_key=key)

    def _on_transfer_event(self, ev) -> None:
        if ev.kind == "landed":
            verdict = self.landing.on_notification(ev.req_id, ev.epoch)
            if verdict == "drained":
                self.planner.release_fence((ev.req_id, ev.epoch))
            elif verdict == "landed" and ev.req_id in self.planner.landing:
                self.epochs.pop(ev.req_id, None)
                self.counts.transfers += 1
                req = self.planner.requests[ev.req_id]
                lp = None
                if ev.payload:
                    m = rpb.TokenLogprob.FromString(ev.payload)
                    lp = Logprob(m.token_id, m.logprob, tuple((t.token_id, t.logprob)
                                                              for t in m.top))
                stopped = self.executor.on_token(req, ev.first_token, lp)
                finished = self.planner.transfer_landed(ev.req_id, ev.first_token, stopped)
                self.outputs.post([self._item(req, bool(finished))])
                for r in finished:
                    self._finished(r)
                self._send(req.peer, "TransferAck", pb.TransferAckRequest(request_id=ev.req_id))
        elif ev.kind == "done":                    # P: our write completed
            self.counts.transfer_seconds.observe(ev.seconds)
        elif ev.kind == "failed":                  # P: our write will not land
            info = self.remote.get(ev.req_id)
            self.counts.transfer_failed("write")
            if info is not None:
                self._send(info[0], "TransferFailed", pb.TransferFailedRequest(
                    request_id=ev.req_id, epoch=ev.epoch, reason=ev.reason))

    def _timers(self, now: float) -> None:
        if self.role is Role.DECODE:
            for ld in self.landing.timed_out(now):
                req = self.planner.requests.get(ld.req_id)
                self._recover_locally(ld.req_id, ld.epoch, "transfer timed out", fence=True,
                                      stage="timeout")
                if req is not None and req.peer:
                    self._send(req.peer, "TransferAck", pb.TransferAckRequest(
                        request_id=ld.req_id, release_only=True))
            for ld in self.landing.expired_fences(now):
                self.planner.release_fence((ld.req_id, ld.epoch))
            if now - self._last_heartbeat >= self.heartbeat_s:
                self._last_heartbeat = now
                by_peer: dict[str, list] = {}
                for req in self.planner.landing.values():
                    by_peer.setdefault(req.peer, []).append(req.id)
                for peer, ids in by_peer.items():
                    self._send(peer, "LeaseHeartbeat", pb.HeartbeatRequest(
                        engine=self.name, incarnation=self.incarnation, request_ids=ids))
        elif self.role is Role.PREFILL:
            for rid in self.leases.expired(now):
                self.transport.cancel(rid)
                if rid in self.planner.requests:
                    self.counts.lease_expiries += 1
                    self.planner.abort(rid, "lease expired")
                    self.remote.pop(rid, None)
                    self.executor.forget(rid)

    def transfer_failed_from_peer(self, r: pb.TransferFailedRequest) -> None:
        # the write failed on P's side and will not land: no fence needed
        if self.epochs.get(r.request_id) == r.epoch and self.landing.forget(r.request_id, r.epoch):
            req = self.planner.requests.get(r.request_id)
            self._recover_locally(r.request_id, r.epoch, r.reason, fence=False,
                                  stage="reported_by_prefill")
            if req is not None:
                self._send(req.peer, "TransferAck", pb.TransferAckRequest(
                    request_id=r.request_id, release_only=True))

    # ---- P: prefilling for D, shipping, acks ------------------------------------
    def remote_prefill(self, r: pb.RemotePrefillRequest) -> None:
        if r.request_id in self.planner.requests:
            raise RejectedRequest(f"request id {r.request_id!r} is live on {self.name}")
        if r.target_engine not in self.peers:
            raise RejectedRequest(f"{self.name} does not know decode engine {r.target_engine!r}")
        twin = Request(r.request_id, list(r.token_ids), SamplingLimits(max_new_tokens=1))
        twin.first_page = r.first_page
        sp = SamplingParams(max_tokens=1, temperature=r.temperature, top_p=r.top_p or 1.0,
                            top_k=r.top_k, seed=r.seed if r.HasField("seed") else None,
                            logprobs=r.logprobs if r.HasField("logprobs") else None)
        self.executor.register(twin.id, sp, fallback_seed=hash(twin.id) & 0xFFFFFFF)
        self.planner.submit(twin)
        self.remote[twin.id] = (r.target_engine, r.target_incarnation, tuple(r.landing_pages),
                                r.epoch)
        self.leases.grant(twin.id, r.target_engine, time.monotonic())

    def _ship(self, op) -> None:
        info = self.remote.get(op.req.id)
        if info is None:
            return
        d_name, d_inc, pages, epoch = info
        if not self.leases.holds(op.req.id, time.monotonic()):
            return                  # the lease ran out: the timers release it, nothing is posted
        t = self.executor.tracked.get(op.req.id)
        payload = logprob_pb(t.logprobs[-1]).SerializeToString() if t and t.logprobs else b""
        src = self.transport.page_ids(op.src)
        if len(src) != len(pages):
            # the two engines group the model's layers differently: nothing sensible to write
            self._send(d_name, "TransferFailed", pb.TransferFailedRequest(
                request_id=op.req.id, epoch=epoch,
                reason=f"{self.name} ships {len(src)} pages where the landing has {len(pages)}: "
                       "run the same model and engine.page_size on both roles"))
            return
        self.transport.write(KvWrite(op.req.id, epoch, Incarnation(d_name, d_inc),
                                     src, pages, op.first_token, payload))
        self.counts.transfers += 1
        self.counts.transfer_bytes += self.transport.bytes_of(src)

    def transfer_ack(self, r: pb.TransferAckRequest) -> None:
        self.transport.cancel(r.request_id)
        if r.request_id in self.planner.requests:
            self.planner.peer_ack(r.request_id)
        self.leases.release(r.request_id)
        self.remote.pop(r.request_id, None)
        self.executor.forget(r.request_id)

    # ---- membership and stats -----------------------------------------------
    def add_peer(self, r: pb.AddPeerRequest) -> None:
        old = self.peers.get(r.engine)
        if old is not None and old.incarnation == r.incarnation:
            return
        channel = grpc.insecure_channel(r.address)
        self.peers[r.engine] = Peer(r.engine, r.incarnation, r.address,
                                    pbg.EngineControlStub(channel))
        if self.transport is not None and r.nixl_metadata:
            self.transport.add_peer(Incarnation(r.engine, r.incarnation), r.nixl_metadata)

    def stats(self) -> pb.EngineStatsResponse:
        p = self.planner
        total = p.total_pages
        used = total - p.free_pages()
        if self.role is Role.PREFILL:
            pinned = used
        else:
            pinned = sum(len(r.state.res.tables[0]) for r in p.landing.values()) + \
                p.held_by_fences()
        c = self.counts
        hist = c.transfer_seconds
        return pb.EngineStatsResponse(
            total_pages=total, used_pages=used, pinned_pages=pinned,
            running=len(p.prefilling) + len(p.running) + len(p.landing) + len(p.transferring),
            waiting=len(p.waiting) + len(p.retracted), role=self.role.value,
            stalls=len(p.stalls), transfer_failures_by_stage=c.failures_by_stage,
            transfer_seconds_buckets=hist.bounds, transfer_seconds_counts=hist.cumulative(),
            transfer_seconds_sum=hist.sum, waiting_requests=waiting_requests_pb(p),
            dtype=self.info()["dtype"], attention=self.info()["attention"],
            kv_capacity_tokens=self.capacity["tokens"], cache_groups=self._group_usage(),
            **c.as_dict())

    def _group_usage(self) -> list:
        coord = self.planner.coord
        return [rpb.CacheGroupUsage(retention=e["retention"], window=e["window"],
                                    layers=e["layers"], total_pages=e["pages"],
                                    used_pages=e["pages"] - coord.available_pages(g),
                                    page_bytes=e["page_bytes"])
                for g, e in enumerate(self.capacity["groups"])]
