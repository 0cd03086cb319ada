"""The gRPC front of the router (pdserve.v1.Router) on grpc.aio: the same
event loop as the HTTP front, no thread per stream. `Generate` is a stream
per request; `GenerateMany` carries many requests over one stream, the
responses of a round in one message. With an API key every
call but the health check needs `authorization: Bearer KEY` in its metadata
(the health check too with router.protect_metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.router.auth import key_matches, refusal
from pdserve.router.errors import ErrorKind, RequestError
from pdserve.router.router import DRAIN_DEADLINE_S, Router
from pdserve.router.mailbox import Mailbox
from pdserve.proto import router_pb2 as pb
from pdserve.proto import router_pb2_grpc as pbg
from pdserve.proto.keepalive import server_options

CODES = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.ABORTED: grpc.StatusCode.ABORTED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}
HEALTH_METHOD = "/grpc.health.v1.Health/"
FIRST_MESSAGE_S = 5.0    # how long a refused streaming call may take to send its first message

log = logging.getLogger("pdserve.router")


class _ApiKey(grpc.aio.ServerInterceptor):
    def __init__(self, key: str, protect_health: bool):
        self.key = key
        self.protect_health = protect_health

    async def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_METHOD) and not self.protect_health:
            return await continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization")
        if key_matches(header, self.key):
            return await continuation(details)
        message = refusal(header, "metadata 'authorization: Bearer <key>'")

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.request_streaming:
            async def refuse_calls(requests, context):
                # take the first message before refusing: a status sent while
                # the client still writes it reached grpc.aio clients as
                # INTERNAL ("Internal error from Core") in 8 of 100 tries
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(anext(aiter(requests), None), FIRST_MESSAGE_S)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                yield  # pragma: no cover - abort raises
            return grpc.stream_stream_rpc_method_handler(
                refuse_calls, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.response_streaming:
            async def refuse_stream(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                yield  # pragma: no cover - abort raises
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            refuse, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


class RouterServicer(pbg.RouterServicer):
    def __init__(self, router: Router):
        self.r = router

    async def _responses(self, request: pb.GenerateRequest):
        """The request's GenerateResponses; a RequestError if it fails."""
        ids, sp = self.r.validate(request)
        adapter = self.r.model_adapter(request.model)
        stream = self.r.open(ids, sp, request.route, request.request_id or None, adapter)
        async with contextlib.aclosing(stream.events()) as deltas:
            async for d in deltas:
                yield pb.GenerateResponse(
                    request_id=stream.id, token_ids=d.token_ids, text=d.text,
                    finish_reason=d.finish_reason, engine=d.engine, logprobs=d.logprobs,
                    prompt_tokens=len(ids) if d.finish_reason else 0,
                    cached_tokens=d.cached_tokens if d.finish_reason else 0)

    async def Generate(self, request, context):
        try:
            async with contextlib.aclosing(self._responses(request)) as responses:
                async for m in responses:
                    yield m
        except RequestError as e:
            await context.abort(CODES[e.kind], e.message)

    async def GenerateMany(self, request_iterator, context):
        """Each tagged request runs as a task that puts its responses in one
        outbox; each write takes everything the outbox holds, so the
        responses of one engine round go out together. A cancel (or the
        client leaving) cancels the request's task, which aborts it on its
        engine as a closed Generate stream does."""
        call = _ManyCall(self._responses, asyncio.get_running_loop())
        reader = call.loop.create_task(call.read(request_iterator))
        # a broken request stream ends the call (and with it every request)
        reader.add_done_callback(lambda t: t.cancelled() or t.exception() is None or call.end())
        try:
            await call.write(context)
        finally:
            reader.cancel()
            for task in list(call.tasks.values()):
                task.cancel()

    async def Abort(self, request, context):
        if not await self.r.abort(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no running request {request.request_id!r}: it finished, "
                                "was never sent, or the id is mistyped")
        return pb.AbortResponse(aborted=True)

    async def ServerInfo(self, request, context):
        return self.r.server_info()

    async def Stats(self, request, context):
        return await self.r.stats()

    async def AddEngine(self, request, context):
        try:
            await self.r.add_engine(request.engine, request.role, request.address)
        except RequestError as e:
            await context.abort(CODES[e.kind], e.message)
        return pb.AddEngineResponse()

    async def Drain(self, request, context):
        deadline = request.deadline_s if request.HasField("deadline_s") else DRAIN_DEADLINE_S
        try:
            return await self.r.drain(request.engine, deadline)
        except RequestError as e:
            await context.abort(CODES[e.kind], e.message)


class _ManyCall:
    """One GenerateMany call: a task per live tag, and the outbox their
    responses wait in for the writer."""

    def __init__(self, responses, loop: asyncio.AbstractEventLoop):
        self.responses = responses                # a request -> its GenerateResponses
        self.loop = loop
        self.outbox = Mailbox(loop)
        self.tasks: dict[int, asyncio.Task] = {}
        self.closed = False                       # the client sent all it will send
        self.ending = False                       # nothing more will come: write and return

    def end(self) -> None:
        self.ending = True
        self.outbox.put(None)                     # wakes the writer

    async def run(self, tag: int, request: pb.GenerateRequest) -> None:
        outbox = self.outbox
        try:
            async with contextlib.aclosing(self.responses(request)) as responses:
                async for m in responses:
                    outbox.put(pb.TaggedResponse(tag=tag, response=m))
        except RequestError as e:
            outbox.put(pb.TaggedResponse(tag=tag, error_code=CODES[e.kind].value[0],
                                         error=e.message))
        except Exception as e:                    # a bug: the client still hears of it
            log.exception("GenerateMany request %d failed", tag)
            outbox.put(pb.TaggedResponse(tag=tag, error_code=grpc.StatusCode.UNKNOWN.value[0],
                                         error=f"{type(e).__name__}: {e}"))

    def forget(self, tag: int, task: asyncio.Task) -> None:
        """The tag's task is done (a task cancelled before it ran too)."""
        del self.tasks[tag]
        if self.closed and not self.tasks:
            self.end()

    async def read(self, request_iterator) -> None:
        tasks = self.tasks
        async for call in request_iterator:
            if call.cancel:
                task = tasks.get(call.tag)
                if task is not None:
                    task.cancel()
            elif call.tag in tasks:
                self.outbox.put(pb.TaggedResponse(
                    tag=call.tag, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    error=f"tag {call.tag} is in use by a live request; give each "
                          "live request a tag of its own"))
            else:
                task = tasks[call.tag] = self.loop.create_task(self.run(call.tag, call.request))
                task.add_done_callback(functools.partial(self.forget, call.tag))
        self.closed = True
        if not tasks:
            self.end()

    async def write(self, context) -> None:
        """Write what the outbox holds, a batch at a time, until the call ends."""
        while True:
            items: Sequence = await self.outbox.take()
            # read before the write: a request that ends while the write
            # is awaited queues its last responses behind this batch
            last = self.ending
            if last:
                items = [m for m in items if m is not None]
            if items:
                await context.write(pb.GenerateBatch(responses=items))
            if last:
                return


async def grpc_server(router: Router, host: str, port: int):
    """A started grpc.aio server for `router`; returns (server, bound port)."""
    sec, rc = router.security, router.cfg.router
    interceptors = [_ApiKey(sec.api_key, rc.protect_metrics)] if sec.api_key else []
    # keepalive: a client's pings accepted, a client gone silent dropped
    server = grpc.aio.server(interceptors=interceptors, options=server_options([
        ("grpc.max_receive_message_length", rc.max_body_bytes),
        # calls not yet taken by a handler: past gRPC's default of 1,000 it resets
        # the newest, which a client saw as CANCELLED with 2,048 streams at once
        ("grpc.server.max_pending_requests", max(1000, 2 * rc.max_requests)),
        ("grpc.server.max_pending_requests_hard_limit", max(3000, 4 * rc.max_requests)),
        # replicas share the port; a lone router must own it (a clash is an error)
        ("grpc.so_reuseport", 1 if rc.replicas > 1 else 0)]))
    pbg.add_RouterServicer_to_server(RouterServicer(router), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    for svc in ("", "pdserve.v1.Router"):
        await hs.set(svc, health_pb2.HealthCheckResponse.SERVING)
    names = (pb.DESCRIPTOR.services_by_name["Router"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    if sec.tls_cert:
        assert sec.tls_key is not None          # Security holds both or neither
        creds = grpc.ssl_server_credentials(
            [(Path(sec.tls_key).read_bytes(), Path(sec.tls_cert).read_bytes())])
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound


class GrpcServer:
    """The gRPC front as one of the router's fronts (router.Front)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.address: str | None = None
        self._server: grpc.aio.Server | None = None

    async def open(self, router: Router) -> None:
        self._server, bound = await grpc_server(router, self.host, self.port)
        self.address = f"{self.host}:{bound}"

    async def close(self) -> None:
        if self._server is None:                # never opened: nothing to stop
            return
        await self._server.stop(grace=1.0)
