"""The router: the client-facing gRPC server (pdserve.v1.Router).

It pairs each request with an engine: a fused engine, or a D engine and a P
engine (least outstanding tokens on each side, but the engine that last
served the same first page wins if it is not much busier, so its prefix
cache is reused; "route" in the request is a hint), streams the engine's tokens back to the client, and carries aborts
and client disconnects to the engine holding the request, which tells its
peer. It also keeps membership: every engine's incarnation, and each P and D
told about the others (addresses and NIXL metadata), again after a restart.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import threading
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import pdserve
from pdserve.cluster.config import ServeConfig
from pdserve.kernels.sampling import SamplingParams
from pdserve.proto import control_pb2 as cpb
from pdserve.proto import control_pb2_grpc as cpbg
from pdserve.proto import router_pb2 as pb
from pdserve.proto import router_pb2_grpc as pbg
from pdserve.scheduler.capacity import max_single_request_tokens

log = logging.getLogger("pdserve.router")
ROUTES = ("", "fused", "disaggregated")


@dataclasses.dataclass
class EngineRef:
    name: str
    role: str
    address: str
    stub: object
    incarnation: int = 0
    alive: bool = True
    load: int = 0


class BadRequest(ValueError):
    pass


class _EngineLost(RuntimeError):
    pass


MAX_RESUBMITS = 3
AFFINITY_SLACK_TOKENS = 4096   # how much more load a warm prefix cache is worth
AFFINITY_ENTRIES = 65536       # first pages remembered (LRU)


class Router:
    def __init__(self, cfg: ServeConfig, tokenizer, vocab_size: int, engines: list[tuple],
                 resolver=None):
        """`engines`: (name, role, address) of every engine. `resolver(name)`
        returns an engine's current address (it changes when Ray restarts it)."""
        self.resolver = resolver
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.engines: dict[str, EngineRef] = {}
        for name, role, address in engines:
            stub = cpbg.EngineControlStub(grpc.insecure_channel(address))
            self.engines[name] = EngineRef(name, role, address, stub)
        self.active: dict[str, tuple] = {}      # request id -> (engine, P, load)
        self.counters = {"resubmitted": 0}
        self._affinity: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.server = None
        self.address = None
        self._stop = threading.Event()

    # ---- membership ------------------------------------------------------------
    def refresh_membership(self) -> bool:
        """Ask every engine who it is; introduce P and D peers to each other
        whenever an incarnation is new. Returns whether anything changed."""
        infos, changed = {}, False
        for ref in self.engines.values():
            try:
                infos[ref.name] = ref.stub.GetInfo(cpb.InfoRequest(), timeout=5)
                ref.alive = True
            except grpc.RpcError:
                address = self._resolve(ref.name)
                if address is None or address == ref.address:
                    changed |= ref.alive
                    ref.alive = False
                    continue
                ref.address = address               # restarted elsewhere: follow it
                ref.stub = cpbg.EngineControlStub(grpc.insecure_channel(address))
                try:
                    infos[ref.name] = ref.stub.GetInfo(cpb.InfoRequest(), timeout=5)
                    ref.alive = True
                except grpc.RpcError:
                    ref.alive = False
                    continue
            if infos[ref.name].incarnation != ref.incarnation:
                ref.incarnation = infos[ref.name].incarnation
                changed = True
        if changed:
            for a in self.engines.values():
                for b in self.engines.values():
                    if a is b or not (a.alive and b.alive) or {a.role, b.role} != {"prefill", "decode"}:
                        continue
                    i = infos[b.name]
                    a.stub.AddPeer(cpb.AddPeerRequest(engine=b.name, incarnation=i.incarnation,
                                                      nixl_metadata=i.nixl_metadata,
                                                      address=i.address), timeout=30)
        return changed

    def _resolve(self, name: str) -> str | None:
        if self.resolver is None:
            return None
        try:
            return self.resolver(name)
        except Exception:                     # not back yet: try again next round
            return None

    def _watch(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.refresh_membership()
            except Exception:                 # keep watching; a bad round is logged
                log.exception("membership refresh failed")

    # ---- requests --------------------------------------------------------------
    def validate(self, r: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        if r.text and r.token_ids:
            raise BadRequest("send either text or token_ids, not both")
        ids = list(r.token_ids) if r.token_ids else (self.tokenizer.encode(r.text) if r.text else [])
        if not ids:
            raise BadRequest("the prompt is empty: send text or token_ids")
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if r.route not in ROUTES:
            raise BadRequest(f"route {r.route!r} is unknown: use '', 'fused' or 'disaggregated'")
        s = r.sampling
        if s.HasField("max_tokens") and s.max_tokens == 0:
            raise BadRequest("sampling.max_tokens must be at least 1 (or unset: until the "
                             "context limit)")
        try:
            sp = SamplingParams(max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
                                temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                                seed=s.seed if s.HasField("seed") else None, stop=tuple(s.stop),
                                stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return ids, sp

    def _choose(self, cands: list, prefix) -> EngineRef:
        """Least outstanding tokens, unless the engine that last served this
        prompt's first page (its prefix cache is warm) is within
        AFFINITY_SLACK_TOKENS of the least loaded."""
        best = min(cands, key=lambda e: (e.load, e.name))
        warm = self._affinity.get((prefix, best.role))
        for e in cands:
            if e.name == warm and e.load <= best.load + AFFINITY_SLACK_TOKENS:
                best = e
        self._affinity[(prefix, best.role)] = best.name
        self._affinity.move_to_end((prefix, best.role))
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return best

    def pick(self, route: str, ids=()) -> tuple[EngineRef, EngineRef | None]:
        live = [e for e in self.engines.values() if e.alive]
        fused = [e for e in live if e.role == "fused"]
        dec = [e for e in live if e.role == "decode"]
        pre = [e for e in live if e.role == "prefill"]
        if not pre:
            dec = []                      # a D engine with no P would prefill everything itself
        cands = fused if route == "fused" else dec if route == "disaggregated" else fused + dec
        if not cands:
            raise LookupError(f"no live engine can serve route {route or 'any'!r}")
        prefix = tuple(ids[:self.cfg.engine.page_size])
        target = self._choose(cands, prefix)
        peer = self._choose(pre, prefix) if target.role == "decode" and pre else None
        return target, peer

    def generate(self, r: pb.GenerateRequest, context):
        """Stream a request from its engine. If the engine dies mid-stream,
        the request is resubmitted (at most MAX_RESUBMITS times) to a live
        engine with the prompt plus the tokens already streamed, and the
        stream continues where it stopped: under greedy decoding the client
        sees exactly the tokens an undisturbed run produces."""
        try:
            ids, sp = self.validate(r)
        except BadRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = r.request_id or uuid.uuid4().hex
        with self._lock:
            if rid in self.active:
                context.abort(grpc.StatusCode.ALREADY_EXISTS,
                              f"request id {rid!r} is running; use a fresh id")
            self.active[rid] = None
        streamed: list[int] = []
        try:
            for attempt in range(MAX_RESUBMITS + 1):
                try:
                    yield from self._attempt(rid, ids + streamed, sp, len(streamed), r.route,
                                             context, streamed)
                    return
                except _EngineLost as lost:
                    if attempt == MAX_RESUBMITS:
                        context.abort(grpc.StatusCode.UNAVAILABLE, str(lost))
                    self.counters["resubmitted"] += 1
                    log.warning("%s: %s; resubmitting with %d streamed tokens", rid, lost,
                                len(streamed))
        finally:
            with self._lock:
                self.active.pop(rid, None)

    def _attempt(self, rid, ids, sp: SamplingParams, done: int, route, context, streamed):
        with self._lock:
            try:
                target, peer = self.pick(route, ids)
            except LookupError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            load = len(ids) + (sp.max_tokens or 256)
            target.load += load
            if peer is not None:
                peer.load += len(ids)
            self.active[rid] = (target, peer, load)
        try:
            sub = cpb.SubmitRequest(
                request_id=rid, token_ids=ids, temperature=sp.temperature, top_p=sp.top_p,
                top_k=sp.top_k, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids),
                ignore_eos=sp.ignore_eos, prefill_peer=peer.name if peer else "")
            if sp.max_tokens is not None:
                sub.max_tokens = sp.max_tokens - done
            if sp.seed is not None:
                sub.seed = sp.seed
            stream = target.stub.Submit(sub)
            context.add_callback(stream.cancel)     # the client left: the engine aborts it
            for ev in stream:
                if ev.error:
                    code = grpc.StatusCode.ABORTED if ev.error.startswith("aborted") \
                        else grpc.StatusCode.INTERNAL
                    context.abort(code, ev.error)
                streamed.extend(ev.token_ids)
                yield pb.GenerateResponse(request_id=rid, token_ids=ev.token_ids, text=ev.text,
                                          finish_reason=ev.finish_reason, engine=target.name)
        except grpc.RpcError as e:
            if not context.is_active():
                return                            # the client went away
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                context.abort(e.code(), e.details())
            target.alive = False                  # until membership sees it again
            raise _EngineLost(f"{target.name} failed mid-stream: {e.code().name}") from None
        finally:
            with self._lock:
                target.load -= load
                if peer is not None:
                    peer.load -= len(ids)

    def abort(self, rid: str) -> bool:
        entry = self.active.get(rid)
        if entry is None or not entry[0].alive:
            return False
        entry[0].stub.Abort(cpb.AbortEngineRequest(request_id=rid, reason="aborted by client"),
                            timeout=10)
        return True

    def stats(self) -> pb.StatsResponse:
        out = []
        for ref in self.engines.values():
            try:
                s = ref.stub.Stats(cpb.InfoRequest(), timeout=10)
            except grpc.RpcError:
                continue
            out.append(pb.EngineStats(
                name=f"pdserve:{ref.name}", role=s.role, total_pages=s.total_pages,
                used_pages=s.used_pages, pinned_pages=s.pinned_pages, running=s.running,
                waiting=s.waiting, finished=s.finished, retractions=s.retractions,
                transfers=s.transfers, transfer_failures=s.transfer_failures,
                lease_expiries=s.lease_expiries))
        return pb.StatsResponse(engines=out)

    def server_info(self) -> pb.ServerInfoResponse:
        m = self.cfg.model
        return pb.ServerInfoResponse(
            version=pdserve.__version__, model=m.path or f"preset:{m.preset}",
            page_size=self.cfg.engine.page_size,
            max_prompt_tokens=max_single_request_tokens(self.cfg.engine),
            engines=[pb.EngineInfo(name=f"pdserve:{e.name}", role=e.role, address=e.address,
                                   incarnation=e.incarnation, alive=e.alive)
                     for e in self.engines.values()])

    # ---- serving ---------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0, watch_s: float = 1.0) -> str:
        self.refresh_membership()
        self.server = grpc.server(cf.ThreadPoolExecutor(64, thread_name_prefix="router"))
        pbg.add_RouterServicer_to_server(_Servicer(self), self.server)
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, self.server)
        for svc in ("", "pdserve.v1.Router"):
            hs.set(svc, health_pb2.HealthCheckResponse.SERVING)
        names = (pb.DESCRIPTOR.services_by_name["Router"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        bound = self.server.add_insecure_port(f"{host}:{port}")
        self.server.start()
        self.address = f"{host}:{bound}"
        threading.Thread(target=self._watch, args=(watch_s,), daemon=True,
                         name="router-membership").start()
        return self.address

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop(grace=1.0).wait(5)


class _Servicer(pbg.RouterServicer):
    def __init__(self, router: Router):
        self.r = router

    def Generate(self, request, context):
        yield from self.r.generate(request, context)

    def Abort(self, request, context):
        if not self.r.abort(request.request_id):
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no running request {request.request_id!r}: it finished, was "
                          "never sent, or the id is mistyped")
        return pb.AbortResponse(aborted=True)

    def ServerInfo(self, request, context):
        return self.r.server_info()

    def Stats(self, request, context):
        return self.r.stats()
