"""One admitted request on the router: `Stream.events()` pairs it
(pairing.py), submits it to the engine that decodes it, and yields its
tokens as `Delta`s from that engine's event stream (engine_link.py). Events
that pile up while the client is still reading go out as one delta. If the
engine dies mid-stream, or its link finds it unhealthy or silent while the
request hears nothing (STALLED), the request is resubmitted to a live one
with the tokens already streamed (a stalled engine may still hold it: its
link aborts it there later); if the client leaves, the engine is told to
abort.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from pdserve.router.engines.link import LOST, STALLED, EngineLink, LinkSignal
from pdserve.router.errors import ErrorKind, RequestError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.engines.pairing import EngineRef, Pairing
from pdserve.text.sampling_params import SamplingParams
from pdserve.router.mailbox import Mailbox
from pdserve.proto import control_pb2 as cpb
from pdserve.proto.sampling import to_options

if TYPE_CHECKING:
    from pdserve.scheduler.lora.adapters import AdapterRef

log = logging.getLogger("pdserve.router")

MAX_RESUBMITS = 3
SUBSCRIBE_WAIT_S = 10.0      # how long a request waits for its engine's event stream


class _EngineLost(RuntimeError):
    pass


class _NotTaken(_EngineLost):
    """The engine did not take the request and nothing was streamed: try
    again (its view of this router was out of date: a subscription that
    ended, a prefill peer it had not met yet)."""


class _EngineDraining(_NotTaken):
    """The engine refused the request because it drains: try another."""


@dataclasses.dataclass
class Delta:
    token_ids: list              # or the engine event's own sequence of ints
    text: str
    logprobs: list               # router_pb2.TokenLogprob, one per token if asked for
    finish_reason: str           # set on the last delta: length | stop
    engine: str
    cached_tokens: int = 0       # on the last delta: prompt tokens the engine found cached


@dataclasses.dataclass(frozen=True)
class StreamContext:
    """What a Stream uses of the router that admitted it, built once by the
    router and shared by its streams: the dicts are the router's own, so a
    stream's entries are the router's."""
    pairing: Pairing                         # picks the engines of each attempt
    links: dict[str, EngineLink]             # engine name -> its event stream
    active: dict[str, tuple | None]          # request id -> (engine, P) once paired
    counters: dict[str, int]                 # "resubmitted", "stalled"
    metrics: RouterMetrics
    stream_interval: int                     # router.stream_interval: tokens a delta holds
    # runs an abort off the stream, kept referenced until it ends
    background: Callable[[Coroutine[Any, Any, None]], None]


class Stream:
    """One admitted request: `events()` yields its Deltas; the router forgets
    it when the generator ends, however it ends."""

    def __init__(self, ctx: StreamContext, rid: str, ids: list[int], sp: SamplingParams,
                 route: str, adapter: AdapterRef | None = None):
        self.ctx = ctx
        self.adapter = adapter          # the LoRA adapter its model names (None: the base)
        self.id = rid
        self.ids = ids
        self.sp = sp
        self.route = route
        self.arrived = time.perf_counter()

    async def events(self):
        """Stream the request from its engine. If the engine dies mid-stream,
        resubmit (at most MAX_RESUBMITS times) to a live engine with the
        prompt plus the tokens already streamed, and continue where it
        stopped: under greedy decoding, or sampling with a seed (the engine
        is told how many tokens are output already: `prior_output`), the
        client sees exactly the tokens an undisturbed run produces."""
        r = self.ctx
        streamed: list[int] = []
        chars = 0                         # of their text, what the client has
        timing = r.metrics.request(len(self.ids), self.arrived)
        try:
            for attempt in range(MAX_RESUBMITS + 1):
                try:
                    attempt_deltas = self._attempt(streamed, chars)
                    if r.stream_interval > 1:
                        attempt_deltas = _every(attempt_deltas, r.stream_interval)
                    async with contextlib.aclosing(attempt_deltas) as deltas:
                        async for d in deltas:
                            # what the client has: tokens an engine made and
                            # stream_interval still held are made again after a
                            # resubmission, not skipped
                            streamed.extend(d.token_ids)
                            chars += len(d.text)
                            timing.tokens(d.engine, len(d.token_ids))
                            if d.finish_reason:
                                timing.finished(d.engine, d.finish_reason)
                            yield d
                    return
                except _EngineLost as lost:
                    if attempt == MAX_RESUBMITS:
                        raise RequestError(ErrorKind.UNAVAILABLE, str(lost)) from None
                    if isinstance(lost, _NotTaken):
                        continue                  # nothing streamed: not a resubmission
                    r.counters["resubmitted"] += 1
                    r.metrics.resubmitted.inc()
                    log.warning("%s: %s; resubmitting with %d streamed tokens", self.id, lost,
                                len(streamed))
        except RequestError as e:
            r.metrics.rejected.labels(reason=e.kind.value).inc()
            raise
        finally:
            r.active.pop(self.id, None)

    async def _attempt(self, streamed: list[int], chars: int):
        """One submission, to the engines picked now, and its deltas until
        it finishes: raises _EngineLost if that engine did not see it
        through, and aborts it there if the client leaves first."""
        r, done = self.ctx, len(streamed)
        ids = self.ids + streamed
        try:
            target, peer = r.pairing.pick(self.route, ids,
                                          self.adapter.id if self.adapter else 0)
        except LookupError as e:
            raise RequestError(ErrorKind.UNAVAILABLE, str(e)) from None
        load = len(ids) + (self.sp.max_tokens or 256)
        target.load += load
        if peer is not None:
            peer.load += len(ids)
        r.active[self.id] = (target, peer)
        sub = self._submission(ids, peer, done, chars)
        link = r.links[target.name]
        box = Mailbox(asyncio.get_running_loop())
        ended = submitted = False
        try:
            await self._submit(target, link, box, sub)
            submitted = True
            backlog: collections.deque = collections.deque()
            while not ended:
                if not backlog:                   # all that came while the client was busy
                    backlog = await box.take()
                ev = backlog.popleft()
                if ev is LOST:
                    ended = True                  # nothing left on that engine to abort
                    target.alive = False
                    raise _EngineLost(f"{target.name} failed mid-stream")
                if ev is STALLED:
                    ended = True                  # the link aborts it there (an orphan)
                    target.orphans.add(self.id)
                    raise self._stalled(target)
                if ev.error:
                    ended = True
                    raise RequestError(_error_kind(ev), ev.error)
                d = _delta(ev, target.name)
                while not d.finish_reason and backlog and _plain(backlog[0]):
                    d = _joined(d, _delta(backlog.popleft(), target.name))
                ended = bool(d.finish_reason)
                yield d
        finally:
            if link.requests.get(self.id) is box:
                del link.requests[self.id]
            if submitted and not ended:           # the client left: the engine aborts it
                r.background(_abort(target, self.id, "client went away"))
            target.load -= load
            if peer is not None:
                peer.load -= len(ids)

    def _submission(self, ids: list[int], peer: EngineRef | None, done: int,
                    chars: int) -> cpb.SubmitRequest:
        """The Submit of `ids` (the prompt and the `done` tokens streamed),
        asking for what is left of the sampling budget."""
        sp = self.sp
        left = to_options(sp, min_tokens=max(sp.min_tokens - done, 0),
                          max_tokens=None if sp.max_tokens is None else sp.max_tokens - done)
        # the engine goes on with the text where the client's ends: what the
        # last engine held back (a possible stop string, half a character) is
        # made again there
        return cpb.SubmitRequest(request_id=self.id, token_ids=ids, sampling=left,
                                 prefill_peer=peer.name if peer else "", prior_output=done,
                                 prior_text_chars=chars,
                                 adapter=self.adapter.name if self.adapter else "",
                                 adapter_id=self.adapter.id if self.adapter else 0)

    async def _submit(self, target: EngineRef, link: EngineLink, box: Mailbox,
                      sub: cpb.SubmitRequest) -> None:
        """Send `sub` to `target` once its event stream is up and a Submit
        slot is free, `box` joined to the subscription it names. Returns
        once the engine took the request; else raises _EngineLost (try
        another engine) or RequestError (the client hears it)."""
        try:
            await asyncio.wait_for(link.ready.wait(), SUBSCRIBE_WAIT_S)
        except asyncio.TimeoutError:
            target.alive = False              # until membership sees it again
            raise _EngineLost(f"{target.name} has no live event stream") from None
        # a slot first (a client gone while queued costs the engine nothing),
        # then the Submit, shielded: once sent, the engine may take it
        await link.submits.acquire()
        if not link.ready.is_set():           # it re-subscribes: its id is changing
            link.submits.release()
            raise _EngineLost(f"{target.name}'s event stream is reconnecting")
        # the box joins the subscription the Submit names, not one that
        # broke (and put LOST in it) while this waited for a slot
        link.requests[self.id] = box
        sub.subscriber = link.subscriber
        submit = asyncio.ensure_future(target.control.Submit(sub, timeout=30))
        submit.add_done_callback(lambda _: link.submits.release())
        try:
            # never cancels the Submit: once sent, the engine may take it
            await asyncio.wait((submit, box.alarm()), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # the client left while the engine was taking the request: abort
            # it there once it has it (an Abort sent now could overtake it)
            self.ctx.background(_abort_once_taken(submit, target, self.id,
                                                     "client went away"))
            raise
        if not submit.done():
            # the link gave up on the engine (STALLED) while it sat on the
            # Submit: an orphan for the link to abort once the Submit ends
            self.ctx.background(_orphan_once_taken(submit, target, self.id))
            raise self._stalled(target)
        try:
            submit.result()
        except grpc.aio.AioRpcError as e:
            raise self._submit_failed(target, e) from None

    def _stalled(self, target: EngineRef) -> _EngineLost:
        """What to raise when the link gave up on `target` for this request."""
        self.ctx.counters["stalled"] += 1
        self.ctx.metrics.stalled.labels(target.name).inc()
        return _EngineLost(f"{target.name} is unhealthy ({target.unhealthy or 'silent'}) and "
                           "sent the request nothing")

    def _submit_failed(self, target: EngineRef, e: grpc.aio.AioRpcError) -> Exception:
        """What a failed Submit means, to raise: the engine marked draining
        or down where it is, and what it may hold of a broken call aborted."""
        code = e.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return RequestError(ErrorKind.INVALID, e.details())
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            target.draining = True            # it drains: picked no more
            return _EngineDraining(e.details())
        if code == grpc.StatusCode.ABORTED:
            return _NotTaken(e.details())
        # the call broke: whatever the engine took of it is aborted there
        self.ctx.background(_abort(target, self.id, "its submission broke off"))
        if code == grpc.StatusCode.CANCELLED:
            # not the engine (gRPC resets calls a server has no room for):
            # it stays live, and the client hears it may retry
            return RequestError(ErrorKind.UNAVAILABLE, f"the router's Submit to {target.name} "
                                "was cancelled by gRPC; retry the request")
        target.alive = False
        return _EngineLost(f"{target.name} did not take the request: {code.name}")


def _error_kind(ev: cpb.RequestEvent) -> ErrorKind:
    """How a front reports an engine's error event: a drain's deadline is
    the server going away (503 / UNAVAILABLE: clients retry it), not a
    client's abort (499 / ABORTED, which none retries)."""
    if ev.error_kind == cpb.ERROR_KIND_DEADLINE:
        return ErrorKind.UNAVAILABLE
    if ev.error_kind == cpb.ERROR_KIND_INVALID:
        return ErrorKind.INVALID              # its grammar did not compile on the engine
    return ErrorKind.ABORTED if ev.error_kind == cpb.ERROR_KIND_ABORTED else ErrorKind.INTERNAL


def _plain(ev) -> bool:
    """An engine event that carries tokens (not the link's signal, not an error)."""
    return not isinstance(ev, LinkSignal) and not ev.error


def _delta(ev, engine: str) -> Delta:
    """The event's tokens as they came (a protobuf sequence, not copied: this
    runs once per token of every stream)."""
    return Delta(ev.token_ids, ev.text, list(ev.logprobs) if ev.logprobs else [],
                 ev.finish_reason, engine, ev.cached_tokens)


def _joined(a: Delta, b: Delta) -> Delta:
    """`a` then `b` as one delta."""
    return Delta([*a.token_ids, *b.token_ids], a.text + b.text, a.logprobs + b.logprobs,
                 b.finish_reason, b.engine, b.cached_tokens or a.cached_tokens)


async def _every(deltas, k: int):
    """The deltas, merged so that each carries at least `k` tokens (the
    last one whatever is left): router.stream_interval."""
    held = None
    async with contextlib.aclosing(deltas):
        async for d in deltas:
            held = d if held is None else _joined(held, d)
            if len(held.token_ids) >= k or held.finish_reason:
                yield held
                held = None
    if held is not None:
        yield held


async def _abort_once_taken(submit: asyncio.Future, ref: EngineRef, rid: str,
                            reason: str) -> None:
    """Abort `rid` on `ref` once its Submit (still in flight) returns. Only
    a refusal left nothing there; a call that broke may have delivered it."""
    try:
        await submit
    except asyncio.CancelledError:
        return
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            return
    await _abort(ref, rid, reason)


async def _orphan_once_taken(submit: asyncio.Future, ref: EngineRef, rid: str) -> None:
    """`rid` moved off `ref` while its Submit was in flight: once the Submit
    ends, unless the engine refused it, it is an orphan the link aborts
    (aborted earlier, an Abort could overtake the Submit)."""
    try:
        await submit
    except asyncio.CancelledError:
        return
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.ABORTED):
            return
    ref.orphans.add(rid)


async def _abort(ref: EngineRef, rid: str, reason: str) -> None:
    try:
        await ref.control.Abort(cpb.AbortEngineRequest(request_id=rid, reason=reason), timeout=10)
    except grpc.aio.AioRpcError as e:               # the engine is gone: nothing left to abort
        log.info("abort of %s on %s: %s", rid, ref.name, e.code().name)
