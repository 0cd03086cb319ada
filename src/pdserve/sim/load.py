"""A served deployment under load, as a client sees it: the requests
(`Sample`: synthetic prompts or a replayed trace's lengths and shared prefixes), their arrivals
(a closed loop, Poisson, or the trace's own times), and `drive`, which sends
them through the gRPC client or the OpenAI HTTP API on one asyncio loop and
times each (TTFT, inter-token gaps, E2E, queueing). `pdserve bench serve`,
`bench sim-accuracy` and `pdserve calibrate --served` drive their loads
through it."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from pdserve.router import event_loop
from pdserve.scheduler.request import BlockPrompt
from pdserve.sim.report import percentile


@dataclass
class Sample:
    prompt: list
    max_tokens: int
    arrival_s: float | None = None      # a trace's arrival; None: synthetic, no schedule


@dataclass
class Timing:
    ok: bool = False
    error: str = ""
    queued: float | None = None         # scheduled arrival -> a worker picks it up
    ttft: float | None = None           # both from the scheduled arrival (open loop)
    e2e: float | None = None            # or from the pick-up (closed loop)
    tokens: int = 0
    gaps: list = field(default_factory=list)

    def seen(self, n: int, t0: float, last: float) -> float:
        """`n` tokens arrived now (the request's clock started at `t0`, the
        previous chunk came at `last`); returns now."""
        now = time.perf_counter()
        if n:
            if self.ttft is None:
                self.ttft = now - t0
            else:
                self.gaps.append(now - last)
            self.tokens += n
            return now
        return last


def arrivals(samples: list[Sample], rate: float | None, seed: int) -> list[float] | None:
    """Each request's scheduled arrival in seconds from the start: Poisson at
    `rate` (seeded), else the trace's own times shifted to start at 0; None
    for a closed loop (synthetic samples, no rate)."""
    if rate:
        rng = random.Random(seed)
        due, out = 0.0, []
        for _ in samples:
            due += rng.expovariate(rate)
            out.append(due)
        return out
    if samples and all(s.arrival_s is not None for s in samples):
        first = min(s.arrival_s for s in samples)  # type: ignore[type-var]
        return [s.arrival_s - first for s in samples]  # type: ignore[operator]
    return None


def workload(n: int, prompt_len: int, max_tokens: int, trace: str | None, limit: int | None,
             max_prompt: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    if trace is None:
        return [Sample([rng.randrange(95) for _ in range(prompt_len)], max_tokens)
                for _ in range(n)]
    from pdserve.sim.trace import read_trace

    out = []
    for t in read_trace(trace, limit=limit or n):
        length = min(len(t.prompt), max_prompt)  # type: ignore[arg-type]
        tokens = block_tokens(t.prompt, length, seed) if isinstance(t.prompt, BlockPrompt) \
            else [rng.randrange(95) for _ in range(length)]
        out.append(Sample(tokens, min(t.max_new_tokens or max_tokens, max_tokens), t.arrival_s))
    return out


def block_tokens(prompt: BlockPrompt, length: int, seed: int) -> list[int]:
    """The first `length` tokens of a trace's prompt named by block hashes
    (Mooncake's hash_ids): each block's tokens drawn from its hash id and
    `seed`, so prompts that share leading blocks share those tokens, as the
    trace's requests share their prefix, and another seed shares nothing
    with this one."""
    out: list[int] = []
    for h in prompt.hash_ids:
        if len(out) >= length:
            break
        rng = random.Random(f"{seed}:{h}")
        out.extend(rng.randrange(95) for _ in range(min(prompt.block_tokens, length - len(out))))
    return out


class _GrpcLoad:
    """Streams through `pdserve.client.AsyncClient`, spread over
    `connections` of its own (one per router replica: the kernel spreads
    connections over replicas that share a port); `multiplex`: each
    connection's requests share one GenerateMany stream. More connections
    than routers only cost: with 8 instead of 1 to one router, a
    GenerateMany write carried 8 responses instead of 63, and per token
    the router spent about 10 us more and the client about 20."""

    def __init__(self, address: str, concurrency: int, multiplex: bool = False,
                 api_key: str | None = None, connections: int = 1):
        from pdserve.client import AsyncClient

        self.clients = [AsyncClient(address, timeout=600, multiplex=multiplex, api_key=api_key)
                        for _ in range(max(1, min(connections, concurrency)))]

    async def stream(self, worker: int, s: Sample):
        """Yields the number of tokens each chunk carries."""
        client = self.clients[worker % len(self.clients)]
        async for chunk in client.generate_stream(s.prompt, max_tokens=s.max_tokens,
                                                  ignore_eos=True):
            yield len(chunk.token_ids)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


class _HttpLoad:
    """Streamed /v1/completions through aiohttp (as vLLM's benchmark client):
    a keep-alive connection per concurrent stream, server-sent events parsed
    as they come."""

    def __init__(self, base_url: str, concurrency: int, api_key: str | None = None,
                 keep_alive: bool = True):
        """`keep_alive=False`: a connection per request (llama.cpp's server
        closes a kept-alive connection after a few requests, and a request
        sent on it as it closes fails)."""
        import aiohttp

        self.url = base_url.rstrip("/") + "/v1/completions"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency, force_close=not keep_alive),
            timeout=aiohttp.ClientTimeout(total=600),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    async def stream(self, worker: int, s: Sample):
        """Yields the tokens each read from the socket brought (one per text
        event); the last count comes from `usage`, since text held back
        across events hides tokens from the count. Events are cut from what
        each read returned, not read line by line: aiohttp's readline cost
        more than the JSON."""
        body = {"prompt": s.prompt, "max_tokens": s.max_tokens, "ignore_eos": True,
                "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            seen, rest = 0, b""
            async for data in resp.content.iter_any():
                *events, rest = (rest + data).replace(b"\r\n", b"\n").split(b"\n\n")
                n = 0
                for e in events:
                    if not e.startswith(b"data: {"):
                        continue
                    event = json.loads(e[6:])
                    if event.get("usage"):
                        n = event["usage"]["completion_tokens"] - seen   # the exact total
                    elif event["choices"] and (event["choices"][0].get("text") or
                                               event["choices"][0]["finish_reason"] is None):
                        n += 1
                if n:
                    seen += n
                    yield n

    async def close(self) -> None:
        await self.session.close()


async def _drive(load, samples: list[Sample], due, timings: list[Timing], concurrency: int,
                 done) -> float:
    """`concurrency` workers on one event loop (no thread per stream, as
    vLLM's and SGLang's benchmark clients) send the samples through `load`;
    returns the wall time."""
    order = sorted(range(len(samples)), key=lambda i: due[i]) if due is not None \
        else list(range(len(samples)))
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in order:
        todo.put_nowait(i)
    start = time.perf_counter()

    async def worker(w: int) -> None:
        while not todo.empty():
            i = todo.get_nowait()
            if due is not None:
                wait = start + due[i] - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)     # pacing arrivals, not waiting on a race
            s, t = samples[i], timings[i]
            picked = last = time.perf_counter()
            t0 = start + due[i] if due is not None else picked
            t.queued = picked - t0
            try:
                async for n in load.stream(w, s):
                    last = t.seen(n, t0, last)
                t.e2e = time.perf_counter() - t0
                t.ok = True
            except Exception as e:            # counted, reported
                t.error = str(e) or type(e).__name__
            done()
    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        await load.close()
    return time.perf_counter() - start


def drive(address: str, samples: list[Sample], concurrency: int, rate: float | None,
          seed: int, progress: bool = True, api: str = "grpc",
          api_key: str | None = None, connections: int = 1, keep_alive: bool = True) -> dict:
    """Send `samples` to `address` and time each: the gRPC HOST:PORT (over
    `connections`), or with api="http" the HTTP base URL (`keep_alive`:
    see _HttpLoad)."""
    from tqdm import tqdm

    timings = [Timing() for _ in samples]
    bar = tqdm(total=len(samples), disable=not progress, unit="req", desc=f"bench serve {api}")
    due = arrivals(samples, rate, seed)

    async def run() -> float:                 # the loads' sessions belong to this loop
        load = _HttpLoad(address, concurrency, api_key, keep_alive) if api == "http" else \
            _GrpcLoad(address, concurrency, multiplex=api == "grpc-many", api_key=api_key,
                      connections=connections)
        return await _drive(load, samples, due, timings, concurrency, lambda: bar.update(1))
    wall = event_loop.run(run())
    bar.close()
    return summary(samples, timings, wall, due, rate)


def summary(samples: list[Sample], timings: list[Timing], wall: float, due, rate) -> dict:
    """A load's figures from each request's timing: what `drive` returns
    (and sim/local_engine.py's in-process load)."""
    ok = [t for t in timings if t.ok]
    tpot = [(t.e2e - t.ttft) / (t.tokens - 1) for t in ok if t.tokens > 1]  # type: ignore[operator]
    gaps = [g for t in ok for g in t.gaps]

    def pct(xs):
        return {"p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9),
                "p99": percentile(xs, 0.99)}
    return {"requests": len(samples), "ok": len(ok), "failed": len(samples) - len(ok),
            "wall_s": wall, "req_per_s": len(ok) / wall,
            "output_tok_per_s": sum(t.tokens for t in ok) / wall,
            "arrivals": "closed loop" if due is None else "rate" if rate else "trace",
            "queued_s": pct([t.queued for t in ok]),
            "ttft_s": pct([t.ttft for t in ok]), "tpot_s": pct(tpot), "itl_s": pct(gaps),
            "e2e_s": pct([t.e2e for t in ok]),
            "errors": sorted({t.error for t in timings if t.error})[:5]}
