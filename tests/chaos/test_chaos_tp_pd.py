"""Chaos between tensor-parallel prefill and decode engines (P TP 2, two D TP 2):
P's worker rank is killed while P holds its requests' writes (a post
delay keeps each write owed, its pages pinned, for 2 s). At the post, P's
gather finds the rank gone: P goes down as one unit (its process exits,
Ray restarts it with both ranks); D's landings time out and D prefills the
requests itself, so every one finishes with the tokens of an undisturbed
TP 1 run, and afterwards no engine keeps a page, pin, fence or lease.
`pytest -m chaos tests/chaos/test_chaos_tp_pd.py`."""

import os
import signal
import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.client import Client

from support.deployed import deployed
from test_chaos import IDLE_BOUND_S, assert_all_idle, fired, set_faults
from test_chaos_tp import RESTART_BOUND_S, _info, _run_all

pytestmark = [pytest.mark.chaos, pytest.mark.slow]     # Ray and four ranks

ENGINE = {"page_size": 16, "total_pages": 512, "max_scheduled_tokens": 64,
          "max_batch_size": 64}
OPTIONS = {"transfer_timeout_s": 3.0, "lease_s": 3.0, "heartbeat_s": 0.5}
PROMPTS = ["chaos monkey", "chaos monkey in the prefill room", "a different prompt"]
TOKENS = 300


@pytest.fixture(scope="module")
def dep():
    cfg = {"model": {"preset": "tiny", "dtype": "float32", "attention": "torch"},
           "engine": ENGINE,
           "cluster": {"prefill": {"count": 1, "tensor_parallel_size": 2},
                       "decode": {"count": 2, "tensor_parallel_size": 2}}}
    with deployed(cfg, engine_options=OPTIONS) as d:
        yield d


@pytest.fixture(scope="module")
def reference():
    sp = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(dtype="float32", attention="torch", **ENGINE)
    return {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, sp, use_tqdm=False))}


def test_a_p_rank_killed_mid_transfer_leaks_no_pin_and_d_finishes_the_requests(dep, reference):
    client = Client(dep.address, timeout=RESTART_BOUND_S)
    pids = _info(dep, "prefill-0")["tp_worker_pids"]
    assert len(pids) == 1
    set_faults(dep, "prefill", [{"stage": "post", "action": "delay", "delay_s": 2.0,
                                 "times": 0}])
    out, errs, threads = _run_all(client, PROMPTS)
    deadline = time.monotonic() + 30
    while fired(dep, "prefill", "post:delay") == 0:        # a write owed, its pages pinned
        assert time.monotonic() < deadline, "P never held a write"
        time.sleep(0.05)                # polling for a state, not waiting out a race
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(RESTART_BOUND_S)
        assert not t.is_alive(), "a request hung"
    assert not errs, errs
    assert out == reference
    # P came back whole (new ranks), and nothing is left held anywhere
    deadline = time.monotonic() + RESTART_BOUND_S
    while True:
        try:
            now = _info(dep, "prefill-0")["tp_worker_pids"]
        except Exception:               # still restarting
            now = []
        if now and now != pids:
            break
        assert time.monotonic() < deadline, "the TP prefill engine did not come back"
        time.sleep(0.1)
    assert_all_idle(dep, IDLE_BOUND_S)
    d = ray.get(dep.actor("decode-0").check.remote(), timeout=30)
    assert d["counters"]["transfer_failures"] >= 1, d["counters"]   # D prefilled them itself


def until_p_prefills(dep, client) -> None:
    """Short requests until one is prefilled on P: the router pairs Ds with
    the restarted P again (until it does, a D prefills by itself, and P
    would hold no write for it)."""
    deadline = time.monotonic() + RESTART_BOUND_S
    while ray.get(dep.actor("prefill-0").check.remote(), timeout=10)["counters"]["rounds"] == 0:
        assert time.monotonic() < deadline, "the router never paired a D with the restarted P"
        client.generate("warm up", max_tokens=1)


def test_a_d_rank_killed_mid_transfer_leaks_no_pin_and_the_requests_finish(dep, reference):
    """A D's worker rank dies while P holds writes into D's landing pages:
    that D goes down whole (Ray restarts it); P's writes to its old
    incarnation fail or its leases run out, so P lets every page go; the
    router resubmits that D's requests to the other D, where they finish
    with the reference's tokens."""
    client = Client(dep.address, timeout=RESTART_BOUND_S)
    assert_all_idle(dep, RESTART_BOUND_S)          # the last test's restarts have settled
    until_p_prefills(dep, client)
    pids = _info(dep, "decode-0")["tp_worker_pids"]
    assert len(pids) == 1
    assert _info(dep, "decode-1")["tp_worker_pids"]
    set_faults(dep, "prefill", [{"stage": "post", "action": "delay", "delay_s": 2.0,
                                 "times": 0}])
    out, errs, threads = _run_all(client, PROMPTS)
    deadline = time.monotonic() + 30
    while fired(dep, "prefill", "post:delay") == 0 or \
            not ray.get(dep.actor("decode-0").check.remote(), timeout=10)["landings"]:
        assert time.monotonic() < deadline, "P never held a write for decode-0"
        time.sleep(0.05)                # polling for a state, not waiting out a race
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(RESTART_BOUND_S)
        assert not t.is_alive(), "a request hung"
    set_faults(dep, "prefill", [])
    assert not errs, errs
    assert out == reference
    assert_all_idle(dep, RESTART_BOUND_S)
