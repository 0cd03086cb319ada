"""Liveness (issue 53): a stuck engine loop, a stuck output thread and a
link that stalls without closing are seen within seconds; the router moves
each request off the engine, token for token what an undisturbed run
gives, and the copy left behind is aborted once the engine answers again,
not decoded on. The engines live in this process (the tiny model on CPU:
one prefill and two decode engines, real gRPC and NIXL, each loop and
output thread its own), a router per test; no Ray. Faults are a job that
blocks the loop thread, a batch that blocks the output thread, and a TCP
proxy that stops forwarding (tests/stall_proxy.py)."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest

from pdserve.client import Client
from pdserve.cluster.actors import build_engine_server
from pdserve.config import ServeConfig
from pdserve.engine.watchdog import Watchdog, WatchdogLimits
from pdserve.kernels.models.loader import load_tokenizer
from pdserve.proto import control_pb2 as cpb
from pdserve.proto import control_pb2_grpc as cpbg
from pdserve.proto.control_tls import channel
from pdserve.router.router import Router
from pdserve.router.serve import serve
from pdserve.scheduler.config import ConfigError, EngineConfig

from support.stall_proxy import StallProxy

STALL_S = 1.0            # engine.stall_unhealthy_s here
SILENT_S = 2.0           # router.engine_silent_s here
MOVE_BOUND_S = 10.0      # a frozen engine's request streams again from another within this
IDLE_BOUND_S = 10.0
ENGINE = {"page_size": 16, "total_pages": 512, "max_scheduled_tokens": 64,
          "max_batch_size": 64, "stall_unhealthy_s": STALL_S, "stuck_loop_restart_s": 0}
SHAPE = (("prefill", 0), ("decode", 0), ("decode", 1))
PROMPT = "liveness: a frozen decode engine must not strand its requests"
N = 2000                 # tokens: ~3 s on the tiny model, so the fault lands mid-decode
LONG = 4000              # ~6 s: a copy whose loop runs on is still decoding when aborted


def config(silent_s: float = SILENT_S, **engine) -> ServeConfig:
    return ServeConfig.from_dict({"cluster": {"prefill": 1, "decode": 2},
                                  "engine": {**ENGINE, **engine},
                                  "router": {"engine_silent_s": silent_s}})


@pytest.fixture(scope="module")
def engines():
    built = {}
    for role, i in SHAPE:
        e = build_engine_server(config(), role, i)
        built[e.name] = e
    yield built
    for e in built.values():
        e.shutdown()


@contextlib.contextmanager
def routed(engines, silent_s: float = SILENT_S, via: dict | None = None):
    """A router over `engines` (engine name -> address overrides in `via`)
    and a client of it; stopped on exit."""
    r = Router(config(silent_s), load_tokenizer(None, "tiny"), 98,
               [(name, e.role.value, (via or {}).get(name, e.address))
                for name, e in engines.items()])
    address = serve(r)
    try:
        with Client(address, timeout=120) as c:
            yield r, c
    finally:
        r.stop()


@pytest.fixture(scope="module")
def reference(engines):
    """The undisturbed run's tokens, by max_tokens."""
    with routed(engines) as (_, c):
        return {n: c.generate(PROMPT, max_tokens=n, ignore_eos=True).token_ids
                for n in (N, LONG)}


class Reader(threading.Thread):
    """One generation streamed on a thread of its own, each chunk's
    arrival stamped."""

    def __init__(self, client: Client, rid: str, max_tokens: int = N):
        super().__init__(daemon=True)
        self.client, self.rid, self.max_tokens = client, rid, max_tokens
        self.chunks: list[tuple[float, list[int]]] = []
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            for c in self.client.generate_stream(PROMPT, request_id=self.rid,
                                                 max_tokens=self.max_tokens, ignore_eos=True):
                self.chunks.append((time.monotonic(), list(c.token_ids)))
        except Exception as e:              # the test reports it
            self.error = e

    @property
    def tokens(self) -> list[int]:
        return [t for _, ts in self.chunks for t in ts]

    def longest_gap(self) -> float:
        times = [t for t, _ in self.chunks]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    def finish(self) -> list[int]:
        self.join(120)
        assert not self.is_alive(), "the request hung"
        assert self.error is None, self.error
        return self.tokens


def until(cond, bound: float, what: str):
    """Wait for `cond()` to be truthy (polled); fail naming `what` past `bound`."""
    deadline = time.monotonic() + bound
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {bound} s"
        time.sleep(0.02)
    return got


def decoding(engines, reader: Reader):
    """The decode engine that holds the reader's request, once it streams."""
    until(lambda: len(reader.tokens) >= 8, 30, "the first tokens")
    holders = [e for name, e in engines.items() if name.startswith("decode")
               and e.request_state(reader.rid) is not None]
    assert len(holders) == 1, holders
    assert len(reader.tokens) < reader.max_tokens // 2, "it ran too far ahead of the fault"
    return holders[0]


def idle_after(engine, counters_before: dict) -> dict:
    """Wait for `engine` to be idle; the counters it moved since `counters_before`."""
    until(lambda: engine.check()["idle"], IDLE_BOUND_S, f"{engine.name} idle")
    after = engine.counters
    return {k: after[k] - counters_before[k] for k in ("finished", "aborted")}


def info(address: str) -> cpb.InfoResponse:
    with channel(address, None) as ch:
        return cpbg.EngineControlStub(ch).GetInfo(cpb.InfoRequest(), timeout=2)


def test_health_answers_while_the_loop_is_stuck(engines):
    """GetInfo is answered off the loop: with the loop thread held it still
    answers at once, unhealthy past engine.stall_unhealthy_s, naming the
    loop; released, healthy again (it went through the loop, and timed out)."""
    d = engines["decode-1"]
    gate = threading.Event()
    d.post_job(gate.wait)
    try:
        got = until(lambda: (i := info(d.address)).unhealthy and i, STALL_S + 5,
                    "an unhealthy answer")
        assert "loop thread stuck" in got.unhealthy and got.loop_quiet_s >= STALL_S
        assert got.outputs_busy_s == 0.0
    finally:
        gate.set()
    until(lambda: not info(d.address).unhealthy, 5, "healthy again")


def test_a_stuck_decode_loop_moves_its_request_token_identical_and_leaves_no_orphan(
        engines, reference):
    """A job holds a D's loop mid-decode: the engine says it is unhealthy,
    the request hears nothing for router.engine_silent_s and moves to the
    other D (stalled, resubmitted), and streams on with exactly the
    undisturbed tokens. Released, the D aborts its copy (aborted, never
    finished) and is idle."""
    with routed(engines) as (r, c):
        reader = Reader(c, "stuck-loop")
        holder = decoding(engines, reader)
        before = holder.counters
        gate = threading.Event()
        holder.post_job(gate.wait)
        try:
            assert reader.finish() == reference[N]
        finally:
            gate.set()
        gap = reader.longest_gap()
        assert STALL_S <= gap <= MOVE_BOUND_S, gap
        assert r.counters == {"resubmitted": 1, "stalled": 1}
        assert idle_after(holder, before) == {"finished": 0, "aborted": 1}
        until(lambda: not r.engines[holder.name].orphans, 5, "the orphan forgotten")


def test_a_stuck_output_thread_is_unhealthy_and_its_request_moves(engines, reference):
    """The D's output thread blocks on a batch mid-decode while its loop
    runs on: unhealthy (naming the output thread), the request moves and
    finishes exactly, and its copy is aborted through the live loop before
    it finishes there."""
    with routed(engines, silent_s=1.0) as (r, c):
        reader = Reader(c, "stuck-outputs", LONG)
        holder = decoding(engines, reader)
        before = holder.counters
        gate, outputs = threading.Event(), holder.outputs
        real = outputs._batch

        def held(batch):
            gate.wait()
            real(batch)
        outputs._batch = held                 # the output thread's next batch blocks
        try:
            got = until(lambda: (i := info(holder.address)).unhealthy and i, STALL_S + 5,
                        "an unhealthy answer")
            assert "output thread stuck" in got.unhealthy
            assert reader.finish() == reference[LONG]
            assert r.counters == {"resubmitted": 1, "stalled": 1}
            until(lambda: holder.request_state(reader.rid) is None, 5, "the copy aborted")
        finally:
            outputs._batch = real
            gate.set()
        assert idle_after(holder, before) == {"finished": 0, "aborted": 1}


def test_a_link_that_stalls_without_closing_is_found_by_keepalive(engines, reference):
    """decode-0 is reached through a proxy that stops forwarding and keeps
    both sockets open. With the router's own silence check out of the way
    (engine_silent_s 60 s), keepalive alone finds the dead link: the event
    stream breaks, the request is resubmitted to decode-1 within the bound
    and finishes exactly. decode-0 cannot tell the router is gone until the
    link closes (its loop decodes the copy on, or its own keepalive drops
    the router after about 2 minutes); once the proxy closes it hears its
    subscriber gone, and ends idle with the copy ended once."""
    proxy = StallProxy(engines["decode-0"].address)
    try:
        with routed(engines, silent_s=60.0, via={"decode-0": proxy.address}) as (r, c):
            reader = Reader(c, "stalled-link")
            holder = decoding(engines, reader)
            assert holder.name == "decode-0"      # least loaded, first by name
            before = holder.counters
            proxy.stall()
            assert reader.finish() == reference[N]
            assert reader.longest_gap() <= MOVE_BOUND_S, reader.longest_gap()
            assert r.counters == {"resubmitted": 1, "stalled": 0}
    finally:
        proxy.close()
    assert sum(idle_after(holder, before).values()) == 1


def test_keepalive_pings_on_an_idle_channel_are_not_refused(engines):
    """A channel that carries nothing pings every KEEPALIVE_TIME_MS; the
    engine's server takes them (gRPC's default answers the third with
    GOAWAY too_many_pings and the connection is dropped): after several
    pings the first connection still serves."""
    from pdserve.proto.keepalive import KEEPALIVE_TIME_MS

    proxy = StallProxy(engines["prefill-0"].address)
    try:
        with channel(proxy.address, None) as ch:
            stub = cpbg.EngineControlStub(ch)
            stub.GetInfo(cpb.InfoRequest(), timeout=5)
            time.sleep(4 * KEEPALIVE_TIME_MS / 1000)   # what is tested: pings over time
            stub.GetInfo(cpb.InfoRequest(), timeout=5)
        assert proxy.connections == 1
    finally:
        proxy.close()


def test_a_loop_stuck_past_the_restart_limit_runs_on_stuck_once():
    """engine.stuck_loop_restart_s: past it the engine calls on_stuck (on a
    deployment: exit, and Ray restarts it) once, naming the stuck thread."""
    stuck: list[str] = []
    cfg = ServeConfig.from_dict({"cluster": {"fused": 1},
                                 "engine": {"stall_unhealthy_s": 0.5,
                                            "stuck_loop_restart_s": 1.5}})
    e = build_engine_server(cfg, "fused", 0, on_stuck=stuck.append)
    gate = threading.Event()
    try:
        e.post_job(gate.wait)
        until(lambda: stuck, 6, "on_stuck")
        assert "loop thread stuck" in stuck[0] and "stuck_loop_restart_s" in stuck[0]
        time.sleep(1.5)                          # the watchdog's next checks fire nothing
        assert len(stuck) == 1
    finally:
        gate.set()
        e.shutdown()


# ---- the watchdog's rules, on a clock the test moves ------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watchdog(clock, on_stuck=None, stall_s=5.0, restart_s=60.0):
    state = {"passed": clock.now, "busy": None}
    w = Watchdog("decode-0", WatchdogLimits(stall_s, restart_s), lambda: state["passed"],
                 lambda: state["busy"], on_stuck, clock)
    return w, state


def test_a_loop_quiet_for_the_stall_limit_is_unhealthy_and_a_pass_heals_it():
    clock = Clock()
    w, state = watchdog(clock)
    clock.now += 4.9
    assert w.health().unhealthy == ""
    clock.now += 0.1
    h = w.health()
    assert h.unhealthy == "loop thread stuck for 5.0 s" and h.loop_quiet_s == 5.0
    state["passed"] = clock.now
    assert w.health().unhealthy == ""


def test_an_idle_output_thread_is_healthy_and_one_on_a_batch_too_long_is_not():
    clock = Clock()
    w, state = watchdog(clock)
    clock.now += 100                              # idle for long: nothing it is behind on
    state["passed"] = clock.now
    assert w.health() == w.health().__class__(0.0, 0.0, "")
    state["busy"] = clock.now
    clock.now += 6
    state["passed"] = clock.now
    h = w.health()
    assert h.outputs_busy_s == 6 and h.unhealthy == "output thread stuck on one batch for 6.0 s"


def test_on_stuck_runs_once_past_the_restart_limit_and_never_once_stopped():
    clock, fired = Clock(), []
    w, _ = watchdog(clock, fired.append, restart_s=60)
    clock.now += 59
    assert not w.check()
    clock.now += 1
    assert w.check() and not w.check() and len(fired) == 1
    w2, _ = watchdog(clock, fired.append, restart_s=60)
    w2.stop()                                     # drained: its loop thread has ended
    clock.now += 1000
    assert not w2.check() and w2.health().unhealthy == "" and len(fired) == 1
    w3, _ = watchdog(clock, fired.append, restart_s=0)
    clock.now += 1000
    assert not w3.check() and len(fired) == 1   # 0: never restarted


def test_the_watchdog_settings_are_checked_with_what_to_change():
    with pytest.raises(ConfigError, match="stall_unhealthy_s must be a number of seconds > 0"):
        EngineConfig(stall_unhealthy_s=0)
    with pytest.raises(ConfigError, match="stuck_loop_restart_s must be a number of seconds >= 0"):
        EngineConfig(stuck_loop_restart_s=-1)
    with pytest.raises(ConfigError, match="stuck_loop_restart_s=3 is not above "
                                          "stall_unhealthy_s=5.*set it to 0"):
        EngineConfig(stuck_loop_restart_s=3)
    assert EngineConfig(stuck_loop_restart_s=0).stuck_loop_restart_s == 0
    with pytest.raises(ConfigError, match="router.engine_silent_s must be a number"):
        ServeConfig.from_dict({"router": {"engine_silent_s": -1}})


def test_a_call_the_stuck_loop_never_reached_ends_deadline_exceeded_when_the_engine_gives_up(
        engines, monkeypatch):
    """The engine's own wait for its loop (rpc.CALL_TIMEOUT_S, here 0.3 s)
    runs out before the caller's deadline (none): the call still ends
    DEADLINE_EXCEEDED, saying the loop is busy or stuck, not UNKNOWN."""
    from pdserve.engine import rpc

    monkeypatch.setattr(rpc, "CALL_TIMEOUT_S", 0.3)
    d = engines["decode-1"]
    gate = threading.Event()
    d.post_job(gate.wait)
    try:
        with channel(d.address, None) as ch:
            with pytest.raises(grpc.RpcError) as e:
                cpbg.EngineControlStub(ch).Stats(cpb.InfoRequest())
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "loop did not run the call before its deadline" in e.value.details()
    finally:
        gate.set()


def test_an_unanswered_call_on_a_stuck_loop_is_not_what_health_waits_for(engines):
    """Stats still goes through the loop: with it stuck, Stats times out
    while GetInfo answers (the router lists such an engine by its health)."""
    d = engines["decode-1"]
    gate = threading.Event()
    d.post_job(gate.wait)
    try:
        with channel(d.address, None) as ch:
            stub = cpbg.EngineControlStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Stats(cpb.InfoRequest(), timeout=0.5)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            stub.GetInfo(cpb.InfoRequest(), timeout=0.5)
    finally:
        gate.set()
