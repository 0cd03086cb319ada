"""An open-loop load on a running deployment, a fault in the middle of it,
and what the issue-53 chaos tests (test_chaos_freeze.py, test_chaos_network.py)
assert and measure about it.

A scenario: the deployment idle; requests sent one every `interval_s`, each on
a thread of its own (a stalled request holds up no later one, as with many
clients); the fault begins (`Fault.begin`), lasts `fault_s`, ends; requests go
on for `after_s`; the sending stops and every request is waited for; then
every engine must be idle again. Each request records when it was sent and
when each chunk arrived, so a stall shows as a gap.

The checks (`Checks`) run together and are reported together: one fault takes
a minute or more, and the question after a run is which rules held, not
only the first that broke.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import grpc

from pdserve.client import Client

LATENESS_BOUND_S = 15.0     # the issue: no request waits more than this past its normal time
STALL_S = 2.0               # a gap this long in a request's stream is the fault's doing
IDLE_BOUND_S = 30.0         # engines idle again once the last request ended
ALIVE_BOUND_S = 30.0        # every engine serving again (router's view) after the fault ends
POLL_S = 0.05


# ---- prompts ------------------------------------------------------------------------------

def long_prompts(n: int, seed: int, shortest: int = 1500, longest: int = 2500) -> list[str]:
    """`n` distinct prompts of printable text (the tiny model's vocabulary:
    a token a character), each beginning with its own index so that no two
    share a first page (no prefix-cache hit between them)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      ,.;-ETAOIN"
    return [f"{seed}:{i:04d} " + "".join(rng.choice(alphabet)
                                          for _ in range(rng.randint(shortest, longest)))
            for i in range(n)]


# ---- one request, and a load of them -------------------------------------------------------

@dataclass
class Outcome:
    """One request as its client saw it (times: time.monotonic())."""
    index: int
    prompt: str
    sent: float
    chunks: list[float] = field(default_factory=list)     # arrival of each chunk
    tokens: list[int] = field(default_factory=list)
    engine: str = ""                                      # the engine that streamed it
    finish_reason: str = ""
    error: str | None = None
    ended: float = 0.0

    @property
    def ttft(self) -> float:
        return (self.chunks[0] if self.chunks else self.ended) - self.sent

    @property
    def latency(self) -> float:
        return self.ended - self.sent

    def moved_on_after(self, t: float) -> float:
        """When the request next moved after `t`: its first chunk after `t`
        (or its end, if none came)."""
        return next((c for c in self.chunks if c > t), self.ended)


class OpenLoopLoad:
    """Sends prompts[i % len(prompts)] at start + i * interval_s until
    `stop_sending`, each request on its own thread through one Client."""

    def __init__(self, address: str, prompts: list[str], interval_s: float, max_tokens: int,
                 tag: str, request_timeout_s: float):
        self.client = Client(address, timeout=request_timeout_s)
        self.prompts, self.interval_s, self.max_tokens, self.tag = (
            prompts, interval_s, max_tokens, tag)
        self.outcomes: list[Outcome] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._sender: threading.Thread | None = None

    def start(self, limit: int | None = None) -> "OpenLoopLoad":
        """Begin sending: `limit` requests, or until stop_sending."""
        self._sender = threading.Thread(target=self._send_all, args=(limit,),
                                        name=f"load-{self.tag}", daemon=True)
        self._sender.start()
        return self

    def wait_sent(self) -> None:
        """Until the sender has sent its last request (start's limit)."""
        if self._sender is not None:
            self._sender.join()

    def in_flight(self) -> int:
        return sum(1 for o in list(self.outcomes) if not o.ended)

    def streaming(self) -> int:
        """Requests in flight that have had a chunk: the client's channel is
        connected (a fault before that would test gRPC's connect timeout)."""
        return sum(1 for o in list(self.outcomes) if o.chunks and not o.ended)

    def stop_sending(self) -> None:
        self._stop.set()
        self.wait_sent()

    def join(self, timeout_s: float) -> list[Outcome]:
        """Every request sent, once each has ended or `timeout_s` has passed
        (one still running then is reported as hung)."""
        self.stop_sending()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for o in self.outcomes:
            if not o.ended:
                o.error = o.error or f"hung: no end within {timeout_s:.0f} s of the last send"
        self.client.close()
        return list(self.outcomes)

    def _send_all(self, limit: int | None = None) -> None:
        start = time.monotonic()
        i = 0
        while not self._stop.is_set() and (limit is None or i < limit):
            wait = start + i * self.interval_s - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                break
            o = Outcome(i, self.prompts[i % len(self.prompts)], time.monotonic())
            self.outcomes.append(o)
            t = threading.Thread(target=self._one, args=(o,), daemon=True)
            self._threads.append(t)
            t.start()
            i += 1

    def _one(self, o: Outcome) -> None:
        try:
            for ch in self.client.generate_stream(o.prompt, request_id=f"{self.tag}-{o.index}",
                                                  max_tokens=self.max_tokens, ignore_eos=True):
                o.chunks.append(time.monotonic())
                o.tokens.extend(ch.token_ids)
                o.engine = ch.engine or o.engine
                o.finish_reason = ch.finish_reason or o.finish_reason
        except grpc.RpcError as e:
            o.error = f"{e.code().name}: {e.details()}"
        except Exception as e:                              # reported by the checks
            o.error = f"{type(e).__name__}: {e}"
        finally:
            o.ended = time.monotonic()


@dataclass
class Reference:
    """The undisturbed run: each prompt's tokens and its normal times."""
    tokens: dict[str, list[int]]
    latency: dict[str, float]
    ttft: dict[str, float]

    def describe(self) -> str:
        lat, ttft = sorted(self.latency.values()), sorted(self.ttft.values())
        return (f"undisturbed: {len(lat)} requests, latency p50 {_p(lat, 50):.2f} s max "
                f"{lat[-1]:.2f} s, TTFT p50 {_p(ttft, 50):.2f} s max {ttft[-1]:.2f} s")


def undisturbed(address: str, prompts: list[str], interval_s: float, max_tokens: int,
                tag: str) -> Reference:
    """Every prompt once, at the load's pace, with no fault; fails if any
    errs (the deployment must serve before a fault can be judged)."""
    load = OpenLoopLoad(address, prompts, interval_s, max_tokens, tag, request_timeout_s=120)
    load.start(limit=len(prompts)).wait_sent()
    out = load.join(120)
    bad = [(o.index, o.error) for o in out if o.error or len(o.tokens) != max_tokens]
    assert not bad, f"the undisturbed run failed, before any fault: {bad[:5]}"
    return Reference({o.prompt: o.tokens for o in out}, {o.prompt: o.latency for o in out},
                     {o.prompt: o.ttft for o in out})


# ---- engines' state, read the way an operator reads it (the router's Stats) ----------------

QUARANTINE_WORD = "quarantin"


def engine_rows(client: Client) -> list[dict]:
    """Each engine's name, requests and pages from the router's Stats, with
    `quarantined`: the value of the Stats field whose name says quarantine
    (issue 53 adds it), or None while EngineStats has no such field."""
    resp = client.stats_response()
    rows = []
    for e in resp.engines:
        fields = {f.name: getattr(e, f.name) for f in e.DESCRIPTOR.fields}
        q = [k for k in fields if QUARANTINE_WORD in k and isinstance(fields[k], int)]
        rows.append({"name": e.name.removeprefix("pdserve:"), "role": e.role,
                     "address": e.address, "running": e.running, "waiting": e.waiting,
                     "used_pages": e.used_pages, "pinned_pages": e.pinned_pages,
                     "quarantined": sum(fields[k] for k in q) if q else None,
                     "quarantine_fields": q})
    return rows


def busy(row: dict) -> bool:
    return bool(row["running"] or row["waiting"] or row["used_pages"] or row["pinned_pages"]
                or row["quarantined"])


def wait_idle(client: Client, names: set[str], bound_s: float) -> tuple[bool, list[dict], float]:
    """Poll until every engine in `names` reports nothing running or waiting
    and no page used, pinned or quarantined. Returns (idle, last rows,
    seconds waited)."""
    start = time.monotonic()
    rows: list[dict] = []
    while True:
        try:
            rows = engine_rows(client)
            if {r["name"] for r in rows} >= names and not any(busy(r) for r in rows):
                return True, rows, time.monotonic() - start
        except grpc.RpcError as e:                      # the router busy: ask again
            rows = [{"error": f"{e.code().name}: {e.details()}"}]
        if time.monotonic() - start > bound_s:
            return False, rows, time.monotonic() - start
        time.sleep(0.2)


def wait_alive(client: Client, names: set[str], bound_s: float) -> tuple[bool, dict]:
    """Poll the router's view until every engine in `names` is alive."""
    deadline = time.monotonic() + bound_s
    alive: dict = {}
    while True:
        try:
            alive = {e["name"].removeprefix("pdserve:"): e["alive"]
                     for e in client.server_info()["engines"]}
            if all(alive.get(n) for n in names):
                return True, alive
        except grpc.RpcError as e:
            alive = {"error": e.code().name}
        if time.monotonic() > deadline:
            return False, alive
        time.sleep(0.2)


def wait_for(cond: Callable[[], bool], bound_s: float, what: str) -> None:
    """Poll `cond` until true; AssertionError naming `what` past `bound_s`."""
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {bound_s:.0f} s"
        time.sleep(POLL_S)


# ---- the checks, reported together ------------------------------------------------------------

class Checks:
    """Named rules, each passed or failed with a line of evidence; `finish`
    prints them all and fails the test with every failure."""

    def __init__(self, title: str):
        self.title = title
        self.results: list[tuple[str, bool, str]] = []

    def check(self, rule: str, ok: bool, evidence: str = "") -> bool:
        self.results.append((rule, bool(ok), evidence))
        return ok

    def finish(self) -> None:
        print(f"\n== {self.title}: checks ==")
        for rule, ok, evidence in self.results:
            print(f"  [{'ok' if ok else 'FAIL'}] {rule}" + (f": {evidence}" if evidence else ""))
        failed = [f"{rule}: {evidence}" for rule, ok, evidence in self.results if not ok]
        assert not failed, f"{self.title}: {len(failed)} rule(s) broken:\n  " + \
            "\n  ".join(failed)


def _p(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def summary(xs: list[float]) -> str:
    if not xs:
        return "none"
    return (f"n={len(xs)} p50 {_p(xs, 50):.2f} s, p90 {_p(xs, 90):.2f} s, max {max(xs):.2f} s, "
            f"mean {statistics.fmean(xs):.2f} s")


class Fault(Protocol):
    """What a scenario does to the deployment, and undoes."""
    name: str
    victim_engine: str | None       # the engine it freezes or cuts off, if one
    stalls_every_stream: bool       # the router itself: no stream can move meanwhile

    def ready(self, load: OpenLoopLoad) -> bool: ...
    def begin(self) -> None: ...
    def end(self) -> None: ...
