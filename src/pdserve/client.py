"""The client library: `Client(address)` and its asyncio twin `AsyncClient`.

    from pdserve.client import Client
    c = Client("127.0.0.1:50051")
    print(c.generate("Hello", max_tokens=32).text)
    for chunk in c.generate_stream("Hello", max_tokens=32):
        print(chunk.text, end="", flush=True)

`AsyncClient(address, multiplex=True)` sends its concurrent requests over
one `GenerateMany` stream: the router answers each engine round with one
message for all of them, where `Generate` costs a message per token of
every stream (the client's and the router's CPU, at high concurrency).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import grpc

from pdserve.router.mailbox import Mailbox
from pdserve.proto import router_pb2 as pb
from pdserve.proto import router_pb2_grpc as pbg
from pdserve.proto.sampling import to_structured


@dataclass
class Chunk:
    request_id: str
    token_ids: list
    text: str
    finish_reason: str
    engine: str
    logprobs: list = field(default_factory=list)   # (token, logprob, [(token, logprob)])


@dataclass
class GenerateResult:
    request_id: str
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str = ""
    engine: str = ""
    logprobs: list = field(default_factory=list)


class RequestFailed(grpc.RpcError):
    """A multiplexed request that ended with an error: `code()` and
    `details()` as a failed `Generate` call has them."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _request(prompt, request_id, route, model="", **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id or "", route=route or "", model=model or "")
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.extend(prompt)
    s = req.sampling
    for key, value in sampling.items():
        if value is None:
            continue
        if key in ("stop", "stop_token_ids"):
            getattr(s, key).extend([value] if isinstance(value, (str, int)) else value)
        elif key == "logit_bias":
            s.logit_bias.update(dict(value))
        elif key == "skip_special_tokens":
            s.keep_special_tokens = not value
        elif key == "structured":           # a text.constraint.Constraint
            s.structured.CopyFrom(to_structured(value))
        else:
            setattr(s, key, value)
    return req


def _chunk(m) -> Chunk:
    return Chunk(m.request_id, list(m.token_ids), m.text, m.finish_reason, m.engine,
                 [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top])
                  for e in m.logprobs])


def _collect(chunks) -> GenerateResult:
    res = None
    for c in chunks:
        if res is None:
            res = GenerateResult(c.request_id)
        res.text += c.text
        res.token_ids += c.token_ids
        res.finish_reason = c.finish_reason or res.finish_reason
        res.engine = c.engine
        res.logprobs += c.logprobs
    return res  # type: ignore[return-value]


def _stats(resp) -> list[dict]:
    keys = ("name", "role", "address", "total_pages", "used_pages", "pinned_pages", "running", "waiting",
            "finished", "aborted", "retractions", "readmissions", "transfers",
            "transfer_failures", "transfer_bytes", "lease_expiries", "fences", "stalls",
            "quarantined_pages", "stale_jobs", "stale_messages",
            "prefix_queries", "prefix_hits", "dtype", "attention", "kv_capacity_tokens",
            "rounds", "round_seconds", "round_cpu_seconds", "round_tokens",
            "unhealthy", "loop_quiet_s", "outputs_busy_s")
    out = []
    for e in resp.engines:
        row = {k: getattr(e, k) for k in keys}
        row["transfer_failures_by_stage"] = dict(e.transfer_failures_by_stage)
        row["cached_tokens_by_tier"] = dict(e.cached_tokens_by_tier)
        row["disk_cache"] = dict(e.disk_cache)
        row["spec_decode"] = dict(e.spec_decode)
        row["spec_accepted_per_pos"] = list(e.spec_accepted_per_pos)
        row["spec_gate"] = e.spec_gate
        row["spec_tokens_per_s"] = (e.spec_tokens_per_s_on, e.spec_tokens_per_s_off)
        row["waiting_requests"] = [
            {"request_id": w.request_id, "reason": w.reason, "detail": w.detail,
             "pages_needed": w.pages_needed, "pages_free": w.pages_free}
            for w in e.waiting_requests]
        row["cache_groups"] = [
            {"retention": g.retention, "window": g.window, "layers": g.layers,
             "total_pages": g.total_pages, "used_pages": g.used_pages, "page_bytes": g.page_bytes}
            for g in e.cache_groups]
        out.append(row)
    return out


def _channel(address: str, tls_ca: str | None, aio: bool):
    """A channel to the router; with `tls_ca` (a PEM file, or "" for the
    system's roots) a TLS one."""
    mod = grpc.aio if aio else grpc
    # a connection of its own (gRPC shares one per address across channels by
    # default): with router replicas behind one port, clients then spread
    options = [("grpc.use_local_subchannel_pool", 1)]
    if tls_ca is None:
        return mod.insecure_channel(address, options=options)
    from pathlib import Path

    creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes() if tls_ca else None)
    return mod.secure_channel(address, creds, options=options)


def _metadata(api_key: str | None):
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class Client:
    def __init__(self, address: str, timeout: float | None = None, *,
                 api_key: str | None = None, tls_ca: str | None = None):
        """`api_key`: the deployment's key (--api-key). `tls_ca`: the PEM file
        that signed the router's certificate (--tls-cert), for TLS."""
        self.address = address
        self.timeout = timeout
        self._channel = _channel(address, tls_ca, aio=False)
        self._md = _metadata(api_key)
        self._stub = pbg.RouterStub(self._channel)

    def generate_stream(self, prompt, *, request_id: str | None = None, route: str = "",
                        max_tokens: int | None = 16, temperature: float = 0.0,
                        top_p: float | None = None, top_k: int | None = None,
                        seed: int | None = None, stop=None, stop_token_ids=None,
                        ignore_eos: bool | None = None, min_tokens: int | None = None,
                        logprobs: int | None = None, presence_penalty: float | None = None,
                        frequency_penalty: float | None = None,
                        repetition_penalty: float | None = None, min_p: float | None = None,
                        logit_bias: dict | None = None,
                        include_stop_str_in_output: bool | None = None,
                        skip_special_tokens: bool | None = None, model: str = "",
                        structured=None):
        """Yield Chunks (new token ids and their text) as they are produced.
        `logprobs=k`: each token's logprob and the k most likely. The
        penalties, min_p, logit_bias ({token id: bias}) and the text options
        are SamplingParams'. `model`: a LoRA adapter's name (or the base
        model's; "" is the base). `structured`: a `Constraint` the output must
        match (text/constraint.py: a JSON schema, a regex, a choice, a grammar)."""
        req = _request(prompt, request_id, route, model, max_tokens=max_tokens,
                       temperature=temperature,
                       top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                       stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                       min_tokens=min_tokens, logprobs=logprobs,
                       presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                       repetition_penalty=repetition_penalty, min_p=min_p, logit_bias=logit_bias,
                       include_stop_str_in_output=include_stop_str_in_output,
                       skip_special_tokens=skip_special_tokens, structured=structured)
        for m in self._stub.Generate(req, timeout=self.timeout, metadata=self._md):
            yield _chunk(m)

    def generate(self, prompt, **kw) -> GenerateResult:
        """The whole answer: text, token ids, finish reason."""
        return _collect(self.generate_stream(prompt, **kw))

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=10,
                                 metadata=self._md).aborted

    def stats(self) -> list[dict]:
        """Per engine: used, pinned and total pages, running and waiting requests."""
        return _stats(self._stub.Stats(pb.StatsRequest(), timeout=30, metadata=self._md))

    def server_info(self) -> dict:
        i = self._stub.ServerInfo(pb.ServerInfoRequest(), timeout=30, metadata=self._md)
        return {"version": i.version, "model": i.model, "page_size": i.page_size,
                "router": i.router, "adapters": list(i.adapters),
                "max_prompt_tokens": i.max_prompt_tokens,
                "engines": [{"name": e.name, "role": e.role, "address": e.address,
                             "incarnation": e.incarnation, "alive": e.alive,
                             "draining": e.draining, "unhealthy": e.unhealthy,
                             "kv_capacity_tokens": e.kv_capacity_tokens} for e in i.engines]}

    def drain(self, engine: str, deadline_s: float | None = None) -> dict:
        """Drain one engine (`role-index`): it takes no new request, finishes
        what it holds (aborting what is left after `deadline_s`, default
        60 s) and stops. Returns its report once it has stopped."""
        req = pb.DrainRequest(engine=engine)
        if deadline_s is not None:
            req.deadline_s = deadline_s
        wait = (deadline_s if deadline_s is not None else 60.0) + 120.0
        r = self._stub.Drain(req, timeout=wait, metadata=self._md)
        return {f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields}

    def add_engine(self, engine: str, role: str, address: str) -> None:
        """Have the router serve an engine started after it (the autoscaler's)."""
        self._stub.AddEngine(pb.AddEngineRequest(engine=engine, role=role, address=address),
                             timeout=120, metadata=self._md)

    def stats_response(self):
        """Stats as the router sent it (router_pb2.StatsResponse): engines and
        the router's own load (arrivals, TTFT and ITL histograms)."""
        return self._stub.Stats(pb.StatsRequest(), timeout=30, metadata=self._md)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Multiplexed:
    """One GenerateMany call that an AsyncClient's requests share, opened
    on first use and again after it ended (the router went away). Each
    request has a tag and a mailbox the call's reader fills. `stub` is
    anything with GenerateMany (a RouterStub, or a scripted one in tests);
    `stream(request, timeout)` yields the request's Chunks."""

    def __init__(self, stub: pbg.RouterStub, metadata):
        self._stub = stub
        self._md = metadata
        self._sends: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self._boxes: dict[int, Mailbox] = {}
        self._tags = itertools.count(1)

    def _open(self) -> asyncio.Queue:
        if self._reader is None or self._reader.done():
            sends = self._sends = asyncio.Queue()

            async def calls():
                while (call := await sends.get()) is not None:
                    yield call
            self._reader = asyncio.ensure_future(
                self._read(self._stub.GenerateMany(calls(), metadata=self._md)))
        return self._sends  # type: ignore[return-value]

    async def _read(self, call) -> None:
        ended = RequestFailed(grpc.StatusCode.UNAVAILABLE,
                              "the router closed the GenerateMany stream before the "
                              "request finished")
        try:
            async for batch in call:
                for r in batch.responses:
                    box = self._boxes.get(r.tag)
                    if box is not None:
                        box.put(r)
        except grpc.aio.AioRpcError as e:
            ended = RequestFailed(e.code(), e.details() or "")
        boxes, self._boxes = self._boxes, {}
        for box in boxes.values():                # whoever still waits hears why
            box.put(ended)

    async def stream(self, req: pb.GenerateRequest, timeout: float | None):
        sends = self._open()
        loop = asyncio.get_running_loop()
        tag = next(self._tags)
        box = self._boxes[tag] = Mailbox(loop)
        sends.put_nowait(pb.GenerateCall(tag=tag, request=req))
        timer = None if timeout is None else loop.call_later(
            timeout, box.put, RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                            f"no full answer within {timeout} s, the "
                                            "client's timeout"))
        finished = False
        try:
            while not finished:
                for r in await box.take():
                    if isinstance(r, RequestFailed):
                        raise r
                    if r.error_code:
                        finished = True
                        raise RequestFailed(_CODES.get(r.error_code, grpc.StatusCode.UNKNOWN),
                                            r.error)
                    finished = bool(r.response.finish_reason)
                    yield _chunk(r.response)
                    if finished:      # a timeout or the call's end behind it is stale
                        break
        finally:
            if timer is not None:
                timer.cancel()
            self._boxes.pop(tag, None)
            if not finished and sends is self._sends:     # left early: the router aborts it
                sends.put_nowait(pb.GenerateCall(tag=tag, cancel=True))

    async def close(self) -> None:
        """Half-close the call; with nothing in flight, wait for it to end
        (what is still in flight ends when the channel closes)."""
        if self._reader is not None and not self._reader.done():
            self._sends.put_nowait(None)  # type: ignore[union-attr]
            if not self._boxes:
                await self._reader


class AsyncClient:
    """The same calls on grpc.aio. `multiplex=True`: generate_stream's
    requests share one GenerateMany stream (their errors are
    `RequestFailed`, with the same `code()` and `details()`)."""

    def __init__(self, address: str, timeout: float | None = None, *,
                 api_key: str | None = None, tls_ca: str | None = None,
                 multiplex: bool = False):
        self.address = address
        self.timeout = timeout
        self._channel = _channel(address, tls_ca, aio=True)
        self._md = _metadata(api_key)
        self._stub = pbg.RouterStub(self._channel)
        self._many = Multiplexed(self._stub, self._md) if multiplex else None

    async def generate_stream(self, prompt, *, request_id=None, route="", max_tokens=16,
                              temperature=0.0, top_p=None, top_k=None, seed=None, stop=None,
                              stop_token_ids=None, ignore_eos=None, min_tokens=None,
                              logprobs=None, presence_penalty=None, frequency_penalty=None,
                              repetition_penalty=None, min_p=None, logit_bias=None,
                              include_stop_str_in_output=None, skip_special_tokens=None,
                              model=""):
        req = _request(prompt, request_id, route, model, max_tokens=max_tokens,
                       temperature=temperature,
                       top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                       stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
                       min_tokens=min_tokens, logprobs=logprobs,
                       presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                       repetition_penalty=repetition_penalty, min_p=min_p, logit_bias=logit_bias,
                       include_stop_str_in_output=include_stop_str_in_output,
                       skip_special_tokens=skip_special_tokens)
        if self._many is not None:
            async for c in self._many.stream(req, self.timeout):
                yield c
            return
        async for m in self._stub.Generate(req, timeout=self.timeout, metadata=self._md):
            yield _chunk(m)

    async def generate(self, prompt, **kw) -> GenerateResult:
        return _collect([c async for c in self.generate_stream(prompt, **kw)])

    async def abort(self, request_id: str) -> bool:
        return (await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=10,
                                 metadata=self._md)).aborted

    async def stats(self) -> list[dict]:
        return _stats(await self._stub.Stats(pb.StatsRequest(), timeout=30, metadata=self._md))

    async def close(self) -> None:
        if self._many is not None:
            await self._many.close()
        await self._channel.close()
