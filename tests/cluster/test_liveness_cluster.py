"""Liveness on a deployment (issue 53): a decode engine whose loop sticks
mid-decode has its request moved within seconds (token-identical), and once
the loop has been stuck past engine.stuck_loop_restart_s its process exits
and Ray restarts it: a new incarnation that serves again. One local Ray
cluster (1P+2D, the tiny model) for the module; tests/test_liveness.py has
the same rules on engines in one process, in seconds."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from pdserve.client import Client

from support.deployed import deployed

pytestmark = pytest.mark.slow

ENGINE = {"page_size": 16, "total_pages": 1024, "max_scheduled_tokens": 256,
          "max_batch_size": 64, "stall_unhealthy_s": 1.0, "stuck_loop_restart_s": 4.0}
PROMPT = "a stuck loop is restarted through Ray"
N = 2000


@pytest.fixture(scope="module")
def dep():
    cfg = {"engine": ENGINE, "cluster": {"prefill": 1, "decode": 2},
           "router": {"engine_silent_s": 2.0}}
    with deployed(cfg) as d:
        yield d


def until(cond, bound: float, what: str):
    deadline = time.monotonic() + bound
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {bound} s"
        time.sleep(0.1)
    return got


def test_a_stuck_decode_loop_moves_its_request_and_is_restarted_through_ray(dep):
    router = dep.router
    actors = {name: a for name, _, a in dep.engines}
    with Client(dep.address, timeout=300) as c:
        reference = c.generate(PROMPT, max_tokens=N, ignore_eos=True).token_ids
        chunks: list[tuple[float, list[int]]] = []

        def read():
            for ch in c.generate_stream(PROMPT, request_id="held", max_tokens=N,
                                        ignore_eos=True):
                chunks.append((time.monotonic(), list(ch.token_ids)))
        t = threading.Thread(target=read, daemon=True)
        t.start()
        until(lambda: sum(len(ts) for _, ts in chunks) >= 8, 60, "the first tokens")
        holder = router.active["held"][0].name
        old = ray.get(actors[holder].info.remote(), timeout=10)["incarnation"]
        ray.get(actors[holder].hold_loop.remote(600), timeout=10)
        t.join(300)
        assert not t.is_alive(), "the request hung"
        assert [x for _, ts in chunks for x in ts] == reference
        times = [s for s, _ in chunks]
        assert max(b - a for a, b in zip(times, times[1:])) < 15
        assert router.counters["stalled"] == 1

        def restarted():
            try:
                return ray.get(actors[holder].info.remote(), timeout=5)["incarnation"] > old
            except Exception:                   # exiting, or starting again
                return False
        until(restarted, 120, f"{holder} restarted")
        until(lambda: router.engines[holder].serving, 60, f"{holder} serving again")
        assert c.generate(PROMPT, max_tokens=16, ignore_eos=True).token_ids == reference[:16]
