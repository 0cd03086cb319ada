"""The client library: `Client(address)` and its asyncio twin `AsyncClient`.

    from pdserve.client import Client
    c = Client("127.0.0.1:50051")
    print(c.generate("Hello", max_tokens=32).text)
    for chunk in c.generate_stream("Hello", max_tokens=32):
        print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from pdserve.proto import router_pb2 as pb
from pdserve.proto import router_pb2_grpc as pbg


@dataclass
class Chunk:
    request_id: str
    token_ids: list
    text: str
    finish_reason: str
    engine: str


@dataclass
class GenerateResult:
    request_id: str
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str = ""
    engine: str = ""


def _request(prompt, request_id, route, **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id or "", route=route or "")
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
        else:
            setattr(s, key, value)
    return req


def _chunk(m) -> Chunk:
    return Chunk(m.request_id, list(m.token_ids), m.text, m.finish_reason, m.engine)


def _collect(chunks) -> GenerateResult:
    res = None
    for c in chunks:
        if res is None:
            res = GenerateResult(c.request_id)
        res.text += c.text
        res.token_ids += c.token_ids
        res.finish_reason = c.finish_reason or res.finish_reason
        res.engine = c.engine
    return res


def _stats(resp) -> list[dict]:
    keys = ("name", "role", "total_pages", "used_pages", "pinned_pages", "running", "waiting",
            "finished", "retractions", "transfers", "transfer_failures", "lease_expiries")
    return [{k: getattr(e, k) for k in keys} for e in resp.engines]


class Client:
    def __init__(self, address: str, timeout: float | None = None):
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address)
        self._stub = pbg.RouterStub(self._channel)

    def generate_stream(self, prompt, *, request_id: str | None = None, route: str = "",
                        max_tokens: int | None = 16, temperature: float = 0.0,
                        top_p: float | None = None, top_k: int | None = None,
                        seed: int | None = None, stop=None, stop_token_ids=None,
                        ignore_eos: bool | None = None):
        """Yield Chunks (new token ids and their text) as they are produced."""
        req = _request(prompt, request_id, route, max_tokens=max_tokens, temperature=temperature,
                       top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                       stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        for m in self._stub.Generate(req, timeout=self.timeout):
            yield _chunk(m)

    def generate(self, prompt, **kw) -> GenerateResult:
        """The whole answer: text, token ids, finish reason."""
        return _collect(self.generate_stream(prompt, **kw))

    def abort(self, request_id: str) -> bool:
        return self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=10).aborted

    def stats(self) -> list[dict]:
        """Per engine: used, pinned and total pages, running and waiting requests."""
        return _stats(self._stub.Stats(pb.StatsRequest(), timeout=30))

    def server_info(self) -> dict:
        i = self._stub.ServerInfo(pb.ServerInfoRequest(), timeout=30)
        return {"version": i.version, "model": i.model, "page_size": i.page_size,
                "max_prompt_tokens": i.max_prompt_tokens,
                "engines": [{"name": e.name, "role": e.role, "address": e.address,
                             "incarnation": e.incarnation, "alive": e.alive} for e in i.engines]}

    def close(self) -> None:
        self._channel.close()


class AsyncClient:
    """The same calls on grpc.aio."""

    def __init__(self, address: str, timeout: float | None = None):
        self.address = address
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pbg.RouterStub(self._channel)

    async def generate_stream(self, prompt, *, request_id=None, route="", max_tokens=16,
                              temperature=0.0, top_p=None, top_k=None, seed=None, stop=None,
                              stop_token_ids=None, ignore_eos=None):
        req = _request(prompt, request_id, route, max_tokens=max_tokens, temperature=temperature,
                       top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                       stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        async for m in self._stub.Generate(req, timeout=self.timeout):
            yield _chunk(m)

    async def generate(self, prompt, **kw) -> GenerateResult:
        return _collect([c async for c in self.generate_stream(prompt, **kw)])

    async def abort(self, request_id: str) -> bool:
        return (await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=10)).aborted

    async def stats(self) -> list[dict]:
        return _stats(await self._stub.Stats(pb.StatsRequest(), timeout=30))

    async def close(self) -> None:
        await self._channel.close()
