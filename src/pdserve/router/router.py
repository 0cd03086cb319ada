"""The router: one process in front of every engine. Its fronts, the gRPC
client API (grpc_api.py) and the OpenAI-compatible HTTP API (http_api.py),
run on its one asyncio event loop, so neither pays a network hop or a
thread per stream to reach the router's logic. The fronts import the
router, never the other way: whoever hosts it hands them to `start`
(serve.py puts the two together).

A request goes: a front validates it (`validate`, `check_prompt`), opens a
`Stream` (stream.py; admission: the in-flight limit, a live route), and iterates its
`events()`: the stream pairs the request (pairing.py), submits it to the
engine that decodes it, and yields its tokens as `Delta`s. If that engine
dies mid-stream, the request is resubmitted to a live one with the tokens
already streamed. Closing a stream early (the client left) cancels the
engine's stream, and the engine aborts the request and tells its peer.
Membership (membership.py) is refreshed on the same loop. `drain` tells an
engine to take no new request, finish what it holds and stop; the router
stops picking it at once, and a request an engine refuses because it drains
is submitted to another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Protocol

import grpc

import pdserve
from pdserve.router.engines import membership
from pdserve.config import ServeConfig
from pdserve.router.engines.link import EngineLink
from pdserve.router.event_loop import new_event_loop
from pdserve.router.metrics import RouterMetrics
from pdserve.router.engines.pairing import ROUTE_ROLES, ROUTES, EngineRef, Pairing
from pdserve.router.errors import ErrorKind, RequestError
from pdserve.router.stream import SUBSCRIBE_WAIT_S, Stream, StreamContext
from pdserve.text.grammar import GrammarError, check_constraint
from pdserve.text.sampling_params import SamplingParams
from pdserve.proto import control_pb2 as cpb
from pdserve.proto import router_pb2 as pb
from pdserve.proto.control_tls import ControlTls
from pdserve.proto.sampling import from_options
from pdserve.scheduler.capacity import ingest_error, max_single_request_tokens
from pdserve.router.lora.sync import AdapterSync
from pdserve.scheduler.lora.adapters import AdapterRef, AdapterRegistry

log = logging.getLogger("pdserve.router")

ADD_ENGINE_WAIT_S = 60.0     # how long a new engine has to answer and subscribe
DRAIN_DEADLINE_S = 60.0      # a drain's default deadline; then what is left is aborted
DRAIN_SLACK_S = 60.0         # past the deadline, for the engine's aborts and its stop
DRAIN_STREAM_END_S = 10.0    # a drained engine's event stream ends this soon after its report
ENGINE_MESSAGE_BYTES = 256 << 20  # what the router takes in one message from an engine


class Front(Protocol):
    """A server that takes clients' requests to the router (grpc_api's
    GrpcServer, http_api's HttpServer). The router opens its fronts on its
    loop once its engines are subscribed, and closes them, the last opened
    first, when it stops."""

    address: str | None          # where it serves, once open

    async def open(self, router: Router) -> None: ...

    async def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Security:
    api_key: str | None = None
    tls_cert: str | None = None  # PEM files; both or neither
    tls_key: str | None = None
    # the router's leaf on the control plane (proto/control_tls.py): how it
    # reaches the engines; None: plaintext (--insecure-control-plane)
    control_tls: ControlTls | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError(f"Security: tls_cert={self.tls_cert!r} and tls_key="
                             f"{self.tls_key!r}: give both PEM files or neither")


class Router:
    def __init__(self, cfg: ServeConfig, tokenizer, vocab_size: int, engines: list[tuple],
                 resolver=None, security: Security = Security(), retire=None,
                 full_history: bool = True):
        """`engines`: (name, role, address) of every engine. `resolver(name)`
        returns an engine's current address (it changes when Ray restarts it).
        `retire(name)` removes an engine that drained and stopped (its Ray
        actor); it runs off the loop. `full_history`: the model has a layer
        that keeps every position (False: every layer slides, so a prompt
        needs no more pages for being long and only the context bounds it)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.resolver = resolver
        self.security = security
        self.retire = retire
        self.engines = {name: EngineRef(name, role, address) for name, role, address in engines}
        self.id = uuid.uuid4().hex[:12]
        self.links: dict[str, EngineLink] = {}
        self._background: set = set()           # fire-and-forget aborts, kept referenced
        self.pairing = Pairing(self.engines, cfg.engine.page_size)
        self.full_history = full_history
        self.max_prompt_tokens = max_single_request_tokens(cfg.engine, full_history)
        self.model_name = cfg.model.served_name
        # LoRA adapters by name: the configured ones get the ids every engine gives them
        self.adapters = AdapterRegistry.from_config(dict(cfg.lora.adapters), self.model_name)
        # every engine starts with the configured adapters (their ids are 1..n)
        self.configured_adapters = {r.id for r in self.adapters.refs()}
        for ref in self.engines.values():
            ref.adapters = set(self.configured_adapters)
        # runtime loads and unloads replayed on engines that (re)join
        self.adapter_sync = AdapterSync(self.adapters)
        self.active: dict[str, tuple | None] = {}   # request id -> (engine, P) once paired
        self.counters = {"resubmitted": 0, "stalled": 0}
        self.errors: list[str] = []             # membership rounds that failed (tests assert none)
        self.metrics = RouterMetrics()
        # what each Stream uses of this router (the dicts shared, not copied)
        self._streams = StreamContext(self.pairing, self.links, self.active, self.counters,
                                      self.metrics, cfg.router.stream_interval, self.background)
        # where its fronts serve: set by whoever started them (serve.py)
        self.address: str | None = None
        self.http_address: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._dial = membership.Dial()

    def pick(self, route: str, ids=()) -> tuple[EngineRef, EngineRef | None]:
        return self.pairing.pick(route, ids)

    # ---- validation (both fronts) ------------------------------------------------
    def encode(self, text: str, param: str = "prompt",
               add_special_tokens: bool = True) -> list[int]:
        """Token ids; a chat template's text is encoded without the BOS the
        tokenizer would add (the template wrote its own), as transformers does."""
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as e:
            raise RequestError(ErrorKind.INVALID, str(e), param) from None

    def model_adapter(self, model: str | None) -> AdapterRef | None:
        """The LoRA adapter a request's `model` selects: None for the base
        model (its name, or no name); a RequestError (404) naming what is
        served for an unknown one."""
        if not model or model == self.model_name:
            return None
        ref = self.adapters.get(model)
        if ref is None:
            raise RequestError(ErrorKind.NOT_FOUND, f"{self.adapters.unknown(model)} "
                               "(GET /v1/models)", "model")
        return ref

    def check_prompt(self, ids: list[int], sp: SamplingParams, param: str = "prompt") -> None:
        """The prompt is servable by this deployment, or a RequestError that
        says what to change (§1.4's bound included)."""
        if not ids:
            raise RequestError(ErrorKind.INVALID,
                               "the prompt is empty: send text or token ids", param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(ErrorKind.INVALID, f"token id {bad} is outside the vocabulary "
                               f"[0, {self.vocab_size})", param)
        bad = next((t for t, _ in sp.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestError(ErrorKind.INVALID, f"logit_bias names token id {bad}, outside the "
                               f"vocabulary [0, {self.vocab_size})", "logit_bias")
        err = ingest_error(self.cfg.engine, len(ids), sp.max_tokens)
        if err:
            param = "max_tokens" if "max_new_tokens" in err and len(ids) <= \
                self.max_prompt_tokens else param
            raise RequestError(ErrorKind.INVALID, err.replace("max_new_tokens", "max_tokens"),
                               param)

    def validate(self, r: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """A gRPC GenerateRequest as (prompt ids, sampling)."""
        if r.text and r.token_ids:
            raise RequestError(ErrorKind.INVALID, "send either text or token_ids, not both")
        if r.route not in ROUTES:
            raise RequestError(ErrorKind.INVALID, f"route {r.route!r} is unknown: use '', "
                               "'fused' or 'disaggregated'", "route")
        s = r.sampling
        if s.HasField("max_tokens") and s.max_tokens == 0:
            raise RequestError(ErrorKind.INVALID, "sampling.max_tokens must be at least 1 (or "
                               "unset: until the context limit)", "max_tokens")
        try:
            sp = from_options(s)
            if sp.constraint is not None:
                check_constraint(sp.constraint)
        except GrammarError as e:
            raise RequestError(ErrorKind.INVALID, f"sampling.structured: {e}",
                               "structured") from None
        except ValueError as e:
            raise RequestError(ErrorKind.INVALID, str(e)) from None
        ids = list(r.token_ids) if r.token_ids else (self.encode(r.text) if r.text else [])
        self.check_prompt(ids, sp)
        return ids, sp

    # ---- requests -------------------------------------------------------------------
    def open(self, ids: list[int], sp: SamplingParams, route: str = "",
             request_id: str | None = None, adapter: AdapterRef | None = None) -> "Stream":
        """Admit a validated request (the in-flight limit, a live route, a
        fresh id); its tokens come from `Stream.events()`."""
        self.admit(1, route)
        return self.stream(ids, sp, route, request_id, adapter)

    def admit(self, streams: int, route: str = "") -> None:
        """Count `streams` arrivals and refuse them together, before any is
        opened, if they cannot all run. Never (a 400, not an arrival): more
        than router.max_requests, or a route none of this deployment's
        engines serve. Not now: too many in flight (429), no live engine for
        the route (503)."""
        limit = self.cfg.router.max_requests
        if streams > limit:
            self.metrics.rejected.labels(reason=ErrorKind.INVALID.value).inc()
            raise RequestError(ErrorKind.INVALID, f"{streams} choices (prompts x n) exceed this "
                               f"deployment's router.max_requests of {limit}, so they could "
                               "never run at once; send fewer prompts or a lower n", "n")
        needs = ROUTE_ROLES.get(route, set())
        if not needs <= {e.role for e in self.engines.values()}:
            self.metrics.rejected.labels(reason=ErrorKind.INVALID.value).inc()
            raise RequestError(ErrorKind.INVALID, f"route {route!r} needs "
                               f"{' and '.join(sorted(needs))} engines, and this deployment "
                               "has none; send route '' (any engine)", "route")
        self.metrics.arrivals.inc(streams)
        if len(self.active) + streams > limit:
            self.metrics.rejected.labels(reason=ErrorKind.OVERLOADED.value).inc()
            raise RequestError(ErrorKind.OVERLOADED, f"{limit} requests are in flight, this "
                               "deployment's router.max_requests; retry later or raise it")
        try:
            self.pairing.candidates(route)
        except LookupError as e:
            raise RequestError(ErrorKind.UNAVAILABLE, str(e)) from None

    def stream(self, ids: list[int], sp: SamplingParams, route: str = "",
               request_id: str | None = None, adapter: AdapterRef | None = None) -> "Stream":
        """A request `admit` let in: a fresh id, then its Stream."""
        rid = request_id or uuid.uuid4().hex
        if rid in self.active:
            raise RequestError(ErrorKind.EXISTS, f"request id {rid!r} is running; use a fresh id",
                               "request_id")
        self.active[rid] = None
        return Stream(self._streams, rid, ids, sp, route, adapter)

    async def abort(self, rid: str) -> bool:
        """True when the engine that owns `rid` aborted it; False when it is
        not running. An engine that no longer knows the request has finished
        it, and its last events are on their way: the stream ends finished,
        so the abort came too late, and saying so keeps "aborted" true."""
        entry = self.active.get(rid)
        if entry is None or not entry[0].alive:
            return False
        ack = await entry[0].control.Abort(cpb.AbortEngineRequest(request_id=rid,
                                                                  reason="aborted by client"),
                                           timeout=10)
        return ack.ok

    async def engine_stats(self) -> list[tuple[EngineRef, cpb.EngineStatsResponse]]:
        refs = [r for r in self.engines.values() if r.stub is not None]
        got = await asyncio.gather(*(r.control.Stats(cpb.InfoRequest(), timeout=5) for r in refs),
                                   return_exceptions=True)
        return [(r, s) for r, s in zip(refs, got) if not isinstance(s, Exception)]

    async def stats(self) -> pb.StatsResponse:
        """Each engine's stats and its liveness as the router sees it. An
        engine that did not answer (a stuck loop, a frozen process) is
        listed with its liveness alone; one drained and retired is not."""
        got = {ref.name: s for ref, s in await self.engine_stats()}
        copied = ({f.name for f in pb.EngineStats.DESCRIPTOR.fields} - {"name"}) & \
            {f.name for f in cpb.EngineStatsResponse.DESCRIPTOR.fields}
        out = []
        for ref in self.engines.values():
            s = got.get(ref.name)
            if s is None and (ref.stub is None or (ref.draining and not ref.alive)):
                continue
            e = pb.EngineStats(name=f"pdserve:{ref.name}", address=ref.address, role=ref.role,
                               unhealthy=ref.unhealthy or ("" if s is not None
                                                           else "no answer to Stats"),
                               loop_quiet_s=ref.loop_quiet_s, outputs_busy_s=ref.outputs_busy_s)
            for f in copied if s is not None else ():
                value = getattr(s, f)
                if hasattr(value, "items"):         # a map field
                    getattr(e, f).update(value)
                elif isinstance(value, (int, float, str)):
                    setattr(e, f, value)
                else:
                    getattr(e, f).extend(value)
            out.append(e)
        return pb.StatsResponse(engines=out, load=self.metrics.load())

    def server_info(self) -> pb.ServerInfoResponse:
        """What any client may know: the engines by name, role and state,
        not where they listen (an operator's `stats` says, behind the API
        key): an engine's port is the cluster's own business."""
        m = self.cfg.model
        return pb.ServerInfoResponse(
            version=pdserve.__version__, model=m.path or f"preset:{m.preset}", router=self.id,
            page_size=self.cfg.engine.page_size, max_prompt_tokens=self.max_prompt_tokens,
            adapters=[r.name for r in self.adapters.refs()],
            engines=[pb.EngineInfo(name=f"pdserve:{e.name}", role=e.role,
                                   incarnation=e.incarnation, alive=e.alive,
                                   kv_capacity_tokens=e.kv_capacity_tokens,
                                   draining=e.draining, unhealthy=e.unhealthy)
                     for e in self.engines.values()])

    # ---- draining --------------------------------------------------------------------
    def engine_named(self, name: str) -> EngineRef:
        """`name` as `role-index` or `pdserve:role-index`; a RequestError
        naming the engines there are otherwise."""
        ref = self.engines.get(name.removeprefix("pdserve:"))
        if ref is None:
            known = ", ".join(sorted(self.engines)) or "none"
            raise RequestError(ErrorKind.NOT_FOUND, f"no engine {name!r} in this deployment; its "
                               f"engines are: {known}", "engine")
        return ref

    async def drain(self, name: str, deadline_s: float = DRAIN_DEADLINE_S) -> pb.DrainResponse:
        """Stop sending `name` new requests and tell it to drain; returns
        its report once it has stopped (past `deadline_s` it aborted what
        was left). Then the engine is retired."""
        ref = self.engine_named(name)
        if deadline_s < 0:
            raise RequestError(ErrorKind.INVALID,
                               f"deadline_s must be >= 0 seconds, got {deadline_s}", "deadline_s")
        if not ref.alive:
            state = "has drained and stopped" if ref.draining else "is not alive"
            raise RequestError(ErrorKind.PRECONDITION,
                               f"engine {ref.name} {state}: nothing to drain")
        ref.draining = True                       # picked no more, from now on
        try:
            report = await ref.control.Drain(cpb.DrainEngineRequest(deadline_s=deadline_s),
                                             timeout=deadline_s + DRAIN_SLACK_S)
        except grpc.aio.AioRpcError as e:
            raise RequestError(ErrorKind.UNAVAILABLE, f"engine {ref.name} did not finish draining: "
                               f"{e.code().name}: {e.details()}") from None
        ref.alive = False
        link = self.links.get(ref.name)
        if link is not None:                      # its last events read before the link goes
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(link.ended.wait(), DRAIN_STREAM_END_S)
            link.stop()
        log.info("drained %s: %s", ref.name, report)
        if self.retire is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.retire, ref.name)
            except Exception:                     # it stopped serving; the process may linger
                log.exception("retiring %s failed", ref.name)
        return report

    async def add_engine(self, name: str, role: str, address: str) -> None:
        """Serve an engine started after the router (the autoscaler's): its
        events subscribed, its P/D peers introduced, then it is picked."""
        name = name.removeprefix("pdserve:")
        if role not in ("prefill", "decode", "fused"):
            raise RequestError(ErrorKind.INVALID,
                               f"role must be prefill, decode or fused, got {role!r}", "role")
        old = self.engines.get(name)
        if old is not None and old.alive:
            raise RequestError(ErrorKind.EXISTS, f"engine {name} is already served", "engine")
        # picked once its events are subscribed and its peers know it, not
        # when it first answers (a request then found no link, or a D that
        # had not met the new P)
        ref = EngineRef(name, role, address, joining=True,
                        adapters=set(self.configured_adapters))
        membership.connect(ref, address, self._dial)
        ref.alive = False                         # not picked until it answered and subscribed
        self.engines[name] = ref
        await membership.refresh(self.engines, self.resolver, self._dial,
                                 self.adapter_sync.observe)
        self.links[name] = link = EngineLink(ref, self.id, self.cfg.router.engine_silent_s)
        link.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(link.ready.wait(), ADD_ENGINE_WAIT_S)
        if not (ref.alive and link.ready.is_set()):
            link.stop()                           # never picked: forgotten whole
            del self.links[name]
            del self.engines[name]
            await membership.disconnect(ref)
            raise RequestError(ErrorKind.UNAVAILABLE, f"engine {name} at {address} did not answer "
                               f"within {ADD_ENGINE_WAIT_S:.0f} s")
        ref.joining = False
        log.info("serving %s (%s) at %s", name, role, address)

    async def drain_all(self, deadline_s: float = DRAIN_DEADLINE_S) -> dict:
        """Drain every live engine at once (a deployment shutting down):
        engine name -> its DrainResponse, or the RequestError it ended with."""
        for ref in self.engines.values():
            ref.draining = True
        names = [name for name, ref in self.engines.items() if ref.alive]
        got = await asyncio.gather(*(self.drain(n, deadline_s) for n in names),
                                   return_exceptions=True)
        return dict(zip(names, got))

    # ---- serving ---------------------------------------------------------------------
    def start(self, fronts: Sequence[Front] = (), watch_s: float = 1.0) -> None:
        """Serve from a thread of its own: its engines subscribed, then
        `fronts` opened on its loop; returns once every front is bound (or
        raises what stopped one)."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = new_event_loop()
            self.loop = loop
            try:
                loop.run_until_complete(self._run(fronts, watch_s, started))
            except BaseException as e:       # handed to start()'s caller
                failure.append(e)
                started.set()
            finally:
                # streams still open end here, on this loop, and their aborts go out
                loop.run_until_complete(loop.shutdown_asyncgens())
                if self._background:
                    loop.run_until_complete(asyncio.wait(list(self._background), timeout=5))
                loop.close()
        self._thread = threading.Thread(target=run, name="router", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]

    async def _run(self, fronts: Sequence[Front], watch_s: float, started) -> None:
        self._stopping = asyncio.Event()
        # the engines' messages (a round's events, GetInfo's NIXL metadata) are
        # trusted traffic: router.max_body_bytes bounds what clients send only
        dial = self._dial = membership.Dial(
            (("grpc.max_receive_message_length", ENGINE_MESSAGE_BYTES),),
            self.security.control_tls)
        for ref in self.engines.values():
            membership.connect(ref, ref.address, dial)
        await membership.refresh(self.engines, self.resolver, dial, self.adapter_sync.observe)
        for ref in self.engines.values():
            self.links[ref.name] = link = EngineLink(ref, self.id, self.cfg.router.engine_silent_s)
            link.start()
        live = [self.links[r.name].ready.wait() for r in self.engines.values() if r.alive]
        with contextlib.suppress(asyncio.TimeoutError):   # a slow one joins when it can
            await asyncio.wait_for(asyncio.gather(*live), SUBSCRIBE_WAIT_S)
        for front in fronts:
            await front.open(self)
        watcher = asyncio.ensure_future(self._watch(watch_s, dial))
        started.set()
        await self._stopping.wait()
        watcher.cancel()
        self.adapter_sync.cancel()
        for link in self.links.values():
            link.stop()
        for front in reversed(fronts):
            await front.close()
        if self._background:                  # aborts the closing streams sent: let them go out
            await asyncio.wait(list(self._background), timeout=5)
        await asyncio.gather(*(membership.disconnect(r) for r in self.engines.values()),
                             return_exceptions=True)

    async def _watch(self, period: float, dial: membership.Dial) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await membership.refresh(self.engines, self.resolver, dial,
                                         self.adapter_sync.observe)
            except Exception as e:            # keep watching; a bad round is logged
                log.exception("membership refresh failed")
                if len(self.errors) < 20:
                    self.errors.append(f"{type(e).__name__}: {e}")

    def background(self, coro) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:          # a stream closed off the loop (at exit): nothing to run on
            coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def run_sync(self, coro, timeout: float = 30.0):
        """Run a coroutine on the router's loop from another thread."""
        assert self.loop is not None, "the router is not running: start() it first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop is not None and self._stopping is not None and self._thread is not None \
                and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(15)
