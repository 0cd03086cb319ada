"""The P/D autoscaler on one local Ray cluster (CPU, the tiny model, short):
a load that rises and falls against 1P+1D with room for 2P+2D. Engines are
added under load and drained after it, one step at a time, and no request
fails."""

import threading
import time

import pytest

from pdserve.client import Client

from support.deployed import deployed

# small decode pools so that load fills them (a D is asked for), and a
# TTFT target that a backlog breaches (a P is asked for)
ENGINE = {"page_size": 16, "total_pages": 32, "max_scheduled_tokens": 256,
          "max_batch_size": 16}
AUTOSCALE = {"prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2},
             "ttft_s": 0.05, "itl_s": 5.0, "interval_s": 1.0, "cooldown_s": 2.0,
             "scale_down_after_s": 4.0, "drain_deadline_s": 60.0, "queue_high": 3}


USERS, NEW = 6, 80     # enough to fill 48 pages of D; few enough for 2 cores to start engines


@pytest.fixture(scope="module")
def deployment():
    cfg = {"engine": ENGINE, "cluster": {"prefill": 1, "decode": 1},
           "autoscale": AUTOSCALE}
    with deployed(cfg, engine_options={"transfer_timeout_s": 30.0}) as dep:
        yield dep


def serving(c: Client) -> list[str]:
    """Engines the router serves: every one not draining or drained (one
    slow to answer a membership check under load is still served)."""
    return sorted(e["name"].removeprefix("pdserve:") for e in c.server_info()["engines"]
                  if not e.get("draining"))


def roles(c: Client) -> dict:
    out = {"prefill": 0, "decode": 0}
    for name in serving(c):
        out[name.rpartition("-")[0]] += 1
    return out


def history(dep) -> list[dict]:
    import ray

    return ray.get(dep.autoscaler.history.remote(), timeout=30)


def test_engines_come_under_load_and_go_after_it_with_no_request_lost(deployment):
    c = Client(deployment.address, timeout=300)
    assert roles(c) == {"prefill": 1, "decode": 1}
    failures, done = [], []
    stop = threading.Event()

    def user(i):
        n = 0
        while not stop.is_set():
            try:
                r = c.generate("load " * (10 + i % 7), max_tokens=NEW, ignore_eos=True)
                done.append(len(r.token_ids))
            except Exception as e:            # every failure is a lost request: counted
                failures.append(repr(e))
            n += 1

    users = [threading.Thread(target=user, args=(i,)) for i in range(USERS)]
    for t in users:
        t.start()
    grown = False
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if roles(c) == {"prefill": 2, "decode": 2}:
            grown = True
            break
        time.sleep(0.5)                       # polling the cluster's shape, not a race
    stop.set()
    for t in users:
        t.join(300)
    assert grown, f"never grew to 2P+2D: {serving(c)}; history {history(deployment)}"
    # calm: the autoscaler drains back to the minimum
    deadline = time.monotonic() + 180
    while roles(c) != {"prefill": 1, "decode": 1} and time.monotonic() < deadline:
        time.sleep(0.5)
    events = history(deployment)
    kinds = [(e["kind"], e["role"]) for e in events]
    assert ("add", "prefill") in kinds and ("add", "decode") in kinds, events
    assert kinds.count(("drain", "prefill")) + kinds.count(("drain", "decode")) >= 2, events
    assert roles(c) == {"prefill": 1, "decode": 1}, serving(c)
    assert not [e for e in events if e["kind"] == "error"], events
    assert failures == [] and done and all(n == NEW for n in done)
    c.close()
