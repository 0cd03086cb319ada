"""Chaos with speculation on: a 1P+2D deployment verifying n-gram candidates
(gate off, so every decode that has candidates verifies them). An abort
while it verifies, a D killed mid-verify (the router resubmits) and a P
killed while writing (D prefills itself) each lose nothing: the tokens are
those of an undisturbed run without speculation, and every engine ends idle
with no page held. `pytest -m chaos` runs them (a Ray cluster of their own)."""

import threading

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.client import Client

from support.deployed import by_name, deployed
from test_chaos import (IDLE_BOUND_S, _abort_at, _kill, _wait_state, assert_all_idle,
                        set_faults, set_faults_after_restart)

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

ENGINE = {"page_size": 16, "total_pages": 512, "max_scheduled_tokens": 64,
          "max_batch_size": 64}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "gate": False}
OPTIONS = {"transfer_timeout_s": 3.0, "lease_s": 3.0, "heartbeat_s": 0.5}
PROMPTS = ["spec spec spec monkey", "a loop a loop a loop a loop", "repeat after me: repeat"]
N = 24


@pytest.fixture(scope="module")
def dep():
    cfg = {"engine": ENGINE, "speculative": SPEC,
           "cluster": {"prefill": 1, "decode": 2, "fused": 0}}
    with deployed(cfg, engine_options=OPTIONS) as d:
        yield d


@pytest.fixture(scope="module")
def reference():
    sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    return {p: o.token_ids for p, o in zip(PROMPTS, LLM(**ENGINE).generate(PROMPTS, sp,
                                                                          use_tqdm=False))}


@pytest.fixture
def client(dep):
    set_faults_after_restart(dep)
    c = Client(dep.address, timeout=120)
    yield c
    assert_all_idle(dep, IDLE_BOUND_S)
    c.close()


def generate_all(client, prompts) -> dict:
    out = {}

    def one(p):
        out[p] = client.generate(p, max_tokens=N, ignore_eos=True).token_ids
    ts = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out


def test_p_d_with_speculation_gives_the_tokens_of_plain_decoding(dep, client, reference):
    assert generate_all(client, PROMPTS) == reference
    ds = [s for n, s in by_name(client).items() if n.startswith("decode")]
    assert sum(d["spec_decode"]["num_drafts"] for d in ds) > 0
    assert sum(d["spec_decode"]["num_accepted_tokens"] for d in ds) > 0
    assert {d["spec_gate"] for d in ds} == {"ungated"}


def test_abort_while_verifying_leaves_nothing(dep, client):
    _abort_at(dep, client, "spec-abort", PROMPTS[1] * 4, "decode", {"Decoding"},
              max_tokens=3000)


def test_d_killed_mid_verify_is_resubmitted_and_loses_nothing(dep, client, reference):
    result = {}
    t = threading.Thread(target=lambda: result.update(out=client.generate(
        PROMPTS[1], request_id="spec-d-dies", max_tokens=N, ignore_eos=True)))
    # P's write held back: the request is still on its way when D dies, or
    # decoding (verifying) once the write lands; either way the router resubmits
    set_faults(dep, "prefill", [{"stage": "post", "action": "delay", "delay_s": 1.0,
                                 "times": 0}])
    t.start()
    victim = _wait_state(dep, "decode", "spec-d-dies", {"RemotePrefilling", "Decoding"})
    _kill(dep, victim)
    set_faults_after_restart(dep)
    t.join(120)
    assert result["out"].token_ids == reference[PROMPTS[1]]


def test_p_killed_while_writing_recovers_on_d_with_speculation(dep, client, reference):
    set_faults(dep, "prefill", [{"stage": "post", "action": "delay", "delay_s": 3.0,
                                 "times": 0}])
    res = {}
    t = threading.Thread(target=lambda: res.update(out=generate_all(client, PROMPTS[:2])))
    t.start()
    _wait_held(dep, "prefill-0")
    _kill(dep, "prefill-0")             # its writes are held back 3 s: none left
    t.join(120)
    assert res["out"] == {p: reference[p] for p in PROMPTS[:2]}
    set_faults_after_restart(dep)


def _wait_held(dep, name, bound=10.0):
    import time

    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if ray.get(dep.actor(name).check.remote())["requests"]:
            return
    raise AssertionError(f"{name} never held a request")
