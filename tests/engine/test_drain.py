"""Graceful drain, end to end on one local Ray cluster (shared by the module):
two fused engines, one prefill and two decode engines behind the router.

A drained engine stops for good, so the tests run in file order and each
takes engines the ones before left: fused-a (drain while it streams),
a decode engine (drain while it streams), prefill-0 (drain mid-transfer,
with the other decode engine), then the last fused engine (the deadline).
Waits poll with a deadline; nothing sleeps to let a race settle."""

import threading
import time

import grpc
import pytest

from pdserve.client import Client
from pdserve.engine.drain import DEADLINE_ABORT, Drain, EngineDraining

from support.deployed import deployed, engine_channel

ENGINE = {"page_size": 16, "total_pages": 512, "max_scheduled_tokens": 64,
          "max_batch_size": 64}
STREAM = 600            # tokens: a generation that outlives the drain's start by far
NEVER = 4000            # a generation no drain deadline here lets finish (test_cluster.LONG)


@pytest.fixture(scope="module")
def deployment():
    cfg = {"engine": ENGINE,
           "cluster": {"prefill": 1, "decode": 2, "fused": 2}}
    with deployed(cfg, engine_options={"transfer_timeout_s": 20.0}) as dep:
        yield dep


@pytest.fixture
def client(deployment):
    c = Client(deployment.address, timeout=120)
    yield c
    wait_idle(c)
    c.close()


def wait_idle(c: Client, seconds: float = 30.0) -> None:
    """Every engine still serving holds no page and runs nothing."""
    deadline = time.monotonic() + seconds
    while True:
        busy = [s for s in c.stats() if s["used_pages"] or s["pinned_pages"] or s["running"]
                or s["waiting"]]
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engines not idle: {busy}")


def poll(what, fn, seconds: float = 20.0):
    """fn()'s first truthy value, polled until the deadline."""
    deadline = time.monotonic() + seconds
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds} s")


def engine_info(c: Client, name: str) -> dict:
    return next(e for e in c.server_info()["engines"] if e["name"] == f"pdserve:{name}")


class Background:
    """fn() on a thread: its result or its exception, joined with a bound."""

    def __init__(self, fn):
        self.result = self.error = None
        self._t = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._t.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except Exception as e:            # read by the test
            self.error = e

    def join(self, seconds: float = 60.0):
        self._t.join(seconds)
        assert not self._t.is_alive(), "did not end in time"
        if self.error is not None:
            raise self.error
        return self.result


def stream_started(c: Client, prompt: str, max_tokens: int, route: str, **kw):
    """A generation streaming in the background, once its first tokens are
    out: (its Background, the engine decoding it, the chunks so far)."""
    chunks: list = []
    first = threading.Event()

    def run():
        for ch in c.generate_stream(prompt, max_tokens=max_tokens, ignore_eos=True,
                                    route=route, **kw):
            chunks.append(ch)
            first.set()
        return chunks
    bg = Background(run)
    poll("the first tokens", lambda: first.is_set() or bg.error, 60)
    if bg.error is not None:
        raise bg.error
    return bg, chunks[0].engine, chunks


# ---- the drain's state, without a cluster ------------------------------------------

def test_a_second_drain_never_extends_the_deadline():
    d = Drain("decode-0")
    d.begin(now=100.0, deadline_s=30.0, live=2)
    d.begin(now=101.0, deadline_s=60.0, live=5)
    assert d.deadline == 130.0 and d.at_start == 2
    d.begin(now=102.0, deadline_s=1.0, live=5)
    assert d.deadline == 103.0
    assert not d.due(102.9) and d.due(103.0)


def test_a_draining_engine_refuses_new_work_and_counts_it():
    d = Drain("prefill-0")
    d.refuse("request")                          # serving: takes it
    d.begin(now=0.0, deadline_s=5.0, live=0)
    with pytest.raises(EngineDraining, match="prefill-0 is draining"):
        d.refuse("prefill")
    assert d.refused == 1


# ---- on the cluster ------------------------------------------------------------------

def test_drain_of_an_unknown_engine_is_a_clear_error(client, deployment, capsys):
    from pdserve.cli.main import main

    with pytest.raises(grpc.RpcError) as e:
        client.drain("decode-7")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no engine 'decode-7'" in e.value.details() and "decode-1" in e.value.details()
    assert main(["drain", "nope", "--address", deployment.address]) == 1
    assert "NOT_FOUND: no engine 'nope'" in capsys.readouterr().err


def test_a_fused_engine_drained_mid_stream_finishes_it_and_takes_nothing_new(client, deployment):
    bg, name, _ = stream_started(client, "drain the fused engine " * 4, STREAM, "fused")
    other = {"fused-0": "fused-1", "fused-1": "fused-0"}[name]
    drain = Background(lambda: client.drain(name, deadline_s=120))
    info = poll("the router marks it draining", lambda: engine_info(client, name)["draining"]
                and engine_info(client, name))
    assert info["alive"]                        # still finishing its stream

    # the engine itself says it drains, and refuses new work with a reason
    # the router acts on (it picks another engine)
    from pdserve.proto import control_pb2 as cpb
    from pdserve.proto import control_pb2_grpc as cpbg

    with engine_channel(deployment, name) as ch:
        stub = cpbg.EngineControlStub(ch)
        poll("the engine drains", lambda: stub.GetInfo(cpb.InfoRequest(), timeout=10).draining)
        with pytest.raises(grpc.RpcError) as e:
            stub.Submit(cpb.SubmitRequest(request_id="late", token_ids=[5, 6, 7],
                                          subscriber="x"), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "draining" in e.value.details()
    assert client.generate("a new request", max_tokens=4, route="fused").engine == other

    chunks = bg.join()
    assert sum(len(c.token_ids) for c in chunks) == STREAM
    assert chunks[-1].finish_reason == "length"
    report = drain.join(120)
    assert report["engine"] == name and not report["deadline_passed"]
    assert report["requests_at_start"] == 1 and report["aborted"] == 0
    assert report["used_pages"] == 0
    gone = engine_info(client, name)
    assert gone["draining"] and not gone["alive"]
    with pytest.raises(grpc.RpcError) as e:     # once is enough
        client.drain(name)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has drained and stopped" in e.value.details()


def test_a_decode_engine_drained_mid_stream_finishes_it(client):
    bg, name, _ = stream_started(client, "drain the decode engine " * 4, STREAM,
                                 "disaggregated")
    assert name.startswith("decode-")
    report = client.drain(name, deadline_s=120)
    chunks = bg.join()
    assert sum(len(c.token_ids) for c in chunks) == STREAM
    assert chunks[-1].finish_reason == "length"
    assert not report["deadline_passed"] and report["requests_at_start"] == 1
    assert report["used_pages"] == 0
    assert not engine_info(client, name)["alive"]


def test_a_prefill_engine_drained_mid_transfer_waits_for_the_ack(client, deployment):
    import ray

    from pdserve.proto import control_pb2 as cpb
    from pdserve.proto import control_pb2_grpc as cpbg
    from pdserve.proto import router_pb2 as rpb

    info = client.server_info()["engines"]
    d = next(e for e in info if e["role"] == "decode" and e["alive"])
    d_name = d["name"].removeprefix("pdserve:")
    before = {s["name"]: s for s in client.stats()}[d["name"]]
    p = deployment.actor("prefill-0")
    # P holds its write back 3 s: the request sits between P's ship and D's landing
    ray.get(p.set_faults.remote([{"stage": "post", "action": "delay", "delay_s": 3.0,
                                  "req_id": "mid-xfer"}]))
    gen = Background(lambda: client.generate("mid transfer " * 8, request_id="mid-xfer",
                                             max_tokens=24, ignore_eos=True,
                                             route="disaggregated"))
    poll("P ships it", lambda: ray.get(p.request_state.remote("mid-xfer")) == "Transferring")
    drain = Background(lambda: client.drain("prefill-0", deadline_s=120))
    with engine_channel(deployment, "prefill-0") as ch:
        poll("P drains", lambda: cpbg.EngineControlStub(ch).GetInfo(
            cpb.InfoRequest(), timeout=10).draining)

    # a request D already holds for P (paired before the drain) is refused by
    # P and prefilled on D at once, not after the landing timeout (20 s)
    with engine_channel(deployment, d_name) as ch:
        stub = cpbg.EngineControlStub(ch)
        events = stub.Subscribe(cpb.SubscribeRequest(subscriber="drain-test"))
        next(events)                                            # live
        started = time.monotonic()
        stub.Submit(cpb.SubmitRequest(request_id="held-for-p", token_ids=list(range(10, 60)),
                                      sampling=rpb.SamplingOptions(max_tokens=6, ignore_eos=True),
                                      prefill_peer="prefill-0", subscriber="drain-test"),
                    timeout=10)
        tokens, last = [], None
        for msg in events:
            for ev in msg.events:
                assert not ev.error, ev.error
                tokens += ev.token_ids
                last = ev
            if last is not None and last.finish_reason:
                break
        events.cancel()
    assert len(tokens) == 6 and time.monotonic() - started < 10

    out = gen.join()
    assert len(out.token_ids) == 24 and out.engine == d_name
    report = drain.join(120)
    # P stopped only once the twin was gone, and it went by D's ack: D landed
    # the write (no local re-prefill) and P held nothing at its stop
    assert not report["deadline_passed"] and report["requests_at_start"] == 1
    assert report["used_pages"] == 0 and report["refused"] >= 1
    after = {s["name"]: s for s in client.stats()}[d["name"]]
    assert after["transfers"] == before["transfers"] + 1
    stages = after["transfer_failures_by_stage"]
    assert stages.get("prefill_draining", 0) == \
        before["transfer_failures_by_stage"].get("prefill_draining", 0) + 1
    assert not engine_info(client, "prefill-0")["alive"]


def test_past_the_deadline_what_is_left_is_aborted_and_the_client_told(client):
    bg, name, _ = stream_started(client, "never ending " * 4, NEVER, "fused",
                                 request_id="forever")
    report = client.drain(name, deadline_s=1.0)
    with pytest.raises(grpc.RpcError) as e:
        bg.join()
    # the server went away, not the client: UNAVAILABLE, which clients retry
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert DEADLINE_ABORT in e.value.details()
    assert report["deadline_passed"] and report["aborted"] == 1
    assert report["used_pages"] == 0            # nothing left held
    assert 1.0 <= report["seconds"] < 30
    with pytest.raises(grpc.RpcError) as e:     # no engine left for the route, and why
        client.generate("after", max_tokens=2, route="fused")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
