"""Chaos with a tensor-parallel engine in the cluster: one fused engine of
tensor_parallel_size 2 beside a prefill and a decode engine. Its worker
rank is killed while it serves: the engine goes down as one unit (its
process exits, Ray restarts it with both ranks), its requests finish
elsewhere with exactly the tokens of an undisturbed run, no engine keeps a
page, pin, fence or lease, and the restarted engine serves again. A P/D
transfer fault meanwhile is recovered as without the TP engine.
`pytest -m chaos tests/chaos/test_chaos_tp.py`."""

import os
import signal
import threading
import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.client import Client

from support.deployed import deployed
from test_chaos import IDLE_BOUND_S, assert_all_idle, set_faults

# Ray and four engine processes: a minute or more
pytestmark = [pytest.mark.chaos, pytest.mark.slow]

ENGINE = {"page_size": 16, "total_pages": 512, "max_scheduled_tokens": 64,
          "max_batch_size": 64}
OPTIONS = {"transfer_timeout_s": 3.0, "lease_s": 3.0, "heartbeat_s": 0.5}
PROMPTS = ["chaos monkey", "chaos monkey in the server room", "a different prompt",
           "tensor parallel chaos", "one more", "and the last of six prompts"]
TOKENS = 300            # long enough to be mid-stream when the rank dies
RESTART_BOUND_S = 120.0


@pytest.fixture(scope="module")
def dep():
    cfg = {"model": {"preset": "tiny", "dtype": "float32", "attention": "torch"},
           "engine": ENGINE,
           "cluster": {"prefill": 1, "decode": 1,
                       "fused": {"count": 1, "tensor_parallel_size": 2}}}
    with deployed(cfg, engine_options=OPTIONS) as d:
        yield d


@pytest.fixture(scope="module")
def reference():
    sp = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(dtype="float32", attention="torch", **ENGINE)
    return {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, sp, use_tqdm=False))}


def _info(dep, name) -> dict:
    return ray.get(dep.actor(name).info.remote(), timeout=30)


def _run_all(client, prompts, route="") -> tuple[dict, list, list]:
    out, errs = {}, []

    def one(p):
        try:
            out[p] = client.generate(p, route=route, max_tokens=TOKENS, ignore_eos=True,
                                     temperature=0.0).token_ids
        except Exception as e:          # a request that fails is the finding
            errs.append(f"{p!r}: {e}")
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return out, errs, threads


def test_a_tp_rank_killed_mid_stream_loses_nothing(dep, reference):
    client = Client(dep.address, timeout=RESTART_BOUND_S)
    pids = _info(dep, "fused-0")["tp_worker_pids"]
    assert len(pids) == 1
    out, errs, threads = _run_all(client, PROMPTS)
    fused = dep.actor("fused-0")
    deadline = time.monotonic() + 30
    while not ray.get(fused.check.remote(), timeout=10)["requests"]:
        assert time.monotonic() < deadline, "the TP engine never took a request"
        time.sleep(0.05)                # polling for a state, not waiting out a race
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(RESTART_BOUND_S)
        assert not t.is_alive(), "a request hung"
    assert not errs, errs
    assert out == reference
    # the engine came back whole: a new worker rank, and it serves
    deadline = time.monotonic() + RESTART_BOUND_S
    while True:
        try:
            now = _info(dep, "fused-0")["tp_worker_pids"]
        except Exception:               # still restarting
            now = []
        if now and now != pids:
            break
        assert time.monotonic() < deadline, "the TP engine did not come back"
        time.sleep(0.1)
    while not dep.router.engines["fused-0"].alive:      # the router met the new incarnation
        assert time.monotonic() < deadline, "the router never saw the TP engine again"
        time.sleep(0.1)
    assert_all_idle(dep, IDLE_BOUND_S)
    again = client.generate(PROMPTS[0], route="fused", max_tokens=TOKENS, ignore_eos=True,
                            temperature=0.0)
    assert again.token_ids == reference[PROMPTS[0]]


def test_a_transfer_fault_beside_the_tp_engine_is_recovered(dep, reference):
    """Posts on P fail twice: D prefills those requests itself; the fused TP
    engine serves its own at the same time; nothing leaks anywhere."""
    client = Client(dep.address, timeout=RESTART_BOUND_S)
    set_faults(dep, "prefill", [{"stage": "post", "action": "fail", "times": 2}])
    pd, pd_errs, pd_threads = _run_all(client, PROMPTS[:3], route="disaggregated")
    fu, fu_errs, fu_threads = _run_all(client, PROMPTS[3:], route="fused")
    for t in pd_threads + fu_threads:
        t.join(RESTART_BOUND_S)
        assert not t.is_alive(), "a request hung"
    set_faults(dep, "prefill", [])
    assert not pd_errs and not fu_errs, pd_errs + fu_errs
    assert {**pd, **fu} == reference
    assert_all_idle(dep, IDLE_BOUND_S)
