"""The benchmarks measure what docs/benchmarks.md says they measure: no
cluster, no NIXL, no model; the I/O each one times is faked."""

import time
from pathlib import Path

import pytest

from pdserve.benchmarks.transfer import handoff
from pdserve.benchmarks.common.traces import AZURE_CONV
from pdserve.sim import load
from pdserve.transfer import Incarnation, KvWrite
from pdserve.transfer.transport import TransferEvent, TransferEventKind

DONE, FAILED = TransferEventKind.DONE, TransferEventKind.FAILED


# ---- bench serve: where a request's clock starts ------------------------------

SERVICE_S = 0.05


def _fake_stream(monkeypatch, service_s: float, picked: list, clients: list | None = None):
    """A server that serves one request at a time per stream: each request
    waits `service_s`, then streams two tokens; `picked` records when each
    one was picked up and which it was; `clients`, which client (each a
    connection of its own) sent each request."""
    import asyncio
    from types import SimpleNamespace

    class FakeClient:
        def __init__(self, address, timeout=None, multiplex=False, api_key=None):
            pass

        async def generate_stream(self, prompt, **kw):
            picked.append((time.perf_counter(), prompt[0]))
            if clients is not None:
                clients.append(id(self))
            await asyncio.sleep(service_s)
            for _ in range(2):
                yield SimpleNamespace(token_ids=[1])

        async def close(self):
            pass
    monkeypatch.setattr("pdserve.client.AsyncClient", FakeClient)


def _samples(n, arrivals=None):
    return [load.Sample([i], 2, None if arrivals is None else arrivals[i]) for i in range(n)]


def test_an_open_loop_past_capacity_counts_queueing_in_ttft(monkeypatch):
    """At a rate 20x what one worker serves, request k cannot see its first
    token before (k+1) services have run, whenever it was picked up: TTFT is
    timed from the scheduled arrival, so the queue shows. The same requests
    in a closed loop are timed from the pick-up and show only the service."""
    _fake_stream(monkeypatch, SERVICE_S, [])
    n = 20
    opened = load.drive("fake", _samples(n), concurrency=1, rate=1000.0, seed=0,
                         progress=False)
    due = load.arrivals(_samples(n), 1000.0, 0)
    assert opened["ok"] == n and opened["arrivals"] == "rate"
    # the median request is about the 10th served: it waited ~9 services
    assert opened["ttft_s"]["p50"] >= 10 * SERVICE_S - max(due)
    assert opened["queued_s"]["p50"] >= 9 * SERVICE_S - max(due)
    assert opened["e2e_s"]["p99"] >= (n - 1) * SERVICE_S - max(due)

    closed = load.drive("fake", _samples(n), concurrency=1, rate=None, seed=0, progress=False)
    assert closed["arrivals"] == "closed loop"
    assert closed["ttft_s"]["p50"] < opened["ttft_s"]["p50"] / 3      # ~1 service, not ~10


def test_the_grpc_load_opens_the_connections_asked_for(monkeypatch):
    """One connection by default (more to one router only split its batched
    writes); --connections N spreads the streams over N, never more than
    there are streams."""
    for asked, concurrency, expected in ((None, 8, 1), (3, 8, 3), (5, 2, 2)):
        clients = []
        _fake_stream(monkeypatch, 0.001, [], clients)
        kw = {} if asked is None else {"connections": asked}
        r = load.drive("fake", _samples(12), concurrency=concurrency, rate=None, seed=0,
                        progress=False, **kw)
        assert r["ok"] == 12
        assert len(set(clients)) == expected, (asked, concurrency)


def test_a_trace_is_replayed_at_its_own_arrival_times(monkeypatch):
    """Trace arrivals (absolute, unsorted) are honoured relative to the
    first: nothing is sent before its time, and an idle server's TTFT is
    its service, not the gap since the run began."""
    picked = []
    _fake_stream(monkeypatch, 0.001, picked)
    arrivals = [100.0, 101.0, 100.5]
    r = load.drive("fake", _samples(3, arrivals), concurrency=3, rate=None, seed=0,
                    progress=False)
    assert r["ok"] == 3 and r["arrivals"] == "trace"
    assert [which for _, which in picked] == [0, 2, 1]           # in arrival order
    t = [at for at, _ in picked]
    assert t[1] - t[0] >= 0.4 and t[2] - t[0] >= 0.9             # 0.5 s and 1 s apart
    assert r["wall_s"] >= 1.0
    assert r["ttft_s"]["p99"] < 0.4                              # not 0.5 or 1 s of idling


def test_arrivals_poisson_is_seeded_and_replaces_a_trace():
    """--rate gives the same Poisson schedule for the same seed, over
    synthetic or trace samples; synthetic samples without a rate have none."""
    traced = _samples(5, [0.0, 1.0, 2.0, 3.0, 4.0])
    a = load.arrivals(traced, 2.0, seed=3)
    assert a == load.arrivals(_samples(5), 2.0, seed=3) != load.arrivals(traced, 2.0, seed=4)
    assert all(x < y for x, y in zip(a, a[1:]))
    assert load.arrivals(traced, None, seed=3) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert load.arrivals(_samples(5), None, seed=3) is None


def test_the_warm_up_never_runs_a_measured_prompt():
    """main() warms each deployment on workload(seed + 1): other prompts."""
    measured = load.workload(8, 32, 4, None, None, 1024, seed=0)
    warm = load.workload(4, 32, 4, None, None, 1024, seed=1)
    assert not {tuple(s.prompt) for s in warm} & {tuple(s.prompt) for s in measured}


# ---- bench transfer: a failure is not a fast transfer --------------------------

class _Agent:
    """A NIXL agent whose prepared WRITE goes through `states`, one a check."""
    def __init__(self, states):
        self.states = list(states)

    def transfer(self, h):
        return self.states.pop(0)

    def check_xfer_state(self, h):
        return self.states.pop(0)


def test_a_raw_write_in_error_is_a_failure_not_a_fast_write():
    assert handoff.time_raw_write(_Agent(["ERR"]), None) is None
    assert handoff.time_raw_write(_Agent(["PROC", "PROC", "ERR"]), None) is None
    assert handoff.time_raw_write(_Agent(["PROC", "DONE"]), None) > 0


class _Transport:
    """A transport whose write completes with `events` (kind, req_id) at the next poll."""
    def __init__(self, events):
        self.events = events

    def write(self, w):
        pass

    def poll(self):
        out, self.events = self.events, []
        return [TransferEvent(kind, rid, 0, None) for kind, rid in out]


def test_a_failed_handoff_is_a_failure_and_a_late_event_is_not_its_completion():
    w = KvWrite("now", 0, Incarnation("d", 1), (0,), (0,))
    assert handoff.time_handoff(_Transport([(FAILED, "now")]), w) is None
    assert handoff.time_handoff(_Transport([(DONE, "now")]), w) > 0
    t = _Transport([(DONE, "earlier")])
    t.write = lambda _: setattr(t, "events", t.events + [(FAILED, "now")])
    assert handoff.time_handoff(t, w) is None


def test_failed_repeats_stay_out_of_every_figure_and_the_ratio_is_per_round():
    """Seconds per repeat, None where it failed: a failure is counted, never
    timed; the ratio pairs each round's two writes, only where both ran."""
    gb = 1e9
    r = handoff.summarize(gb, hand=[1.0, None, 0.5, 2.0], raw=[1.0, 1.0, None, 1.0],
                          copies=[0.1] * 4, runs=[0.5, 0.5, 0.5, None])
    assert r["failed"] == {"handoff": 2, "raw": 1}              # the run's failure counts too
    assert r["handoff"].n == 3 and r["handoff"].hi == 2.0        # the fast 0.5 s one: 2 GB/s
    assert r["raw"].n == 3 and r["raw"].median == 1.0
    assert r["ratio"].n == 2 and (r["ratio"].lo, r["ratio"].hi) == (0.5, 1.0)
    assert r["run"].n == 3 and r["run_ratio"].n == 2 and r["run_ratio"].median == 2.0
    assert handoff.summarize(gb, [None], [1.0], [0.1], [None])["ratio"] is None


def test_handoff_and_raw_alternate_which_runs_first():
    orders = [handoff.pair_order(r) for r in range(4)]
    assert orders == [("handoff", "raw"), ("raw", "handoff")] * 2


def test_spread_gives_median_quartiles_and_range():
    s = handoff.spread([5.0, 1.0, None, 3.0, 2.0, 4.0])
    assert (s.median, s.p25, s.p75, s.lo, s.hi, s.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert handoff.spread([None]) is None


# ---- bench llm: warm-up on the row's shape, other prompts ----------------------

@pytest.mark.parametrize("kind", ["uniform", "trace"])
def test_llm_warms_up_on_the_rows_shape_with_other_prompts(kind):
    from pdserve.benchmarks.engine import llm

    if kind == "trace" and not Path(AZURE_CONV).exists():
        pytest.skip("the Azure trace is not in ../shared/data")
    for batch in (1, 8):
        row = llm.workload(kind, batch, 98, AZURE_CONV, 8)
        warm = llm.workload(kind, batch, 98, AZURE_CONV, 8, warm=True)
        assert [(len(p), n) for p, n in warm] == [(len(p), n) for p, n in row[:batch]]
        pages = {tuple(p[:16]) for p, _ in row if len(p) >= 16}      # a page can be reused
        assert not {tuple(p[:16]) for p, _ in warm if len(p) >= 16} & pages
