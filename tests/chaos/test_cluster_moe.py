"""DeepSeek-V3 (latent attention, experts) through the cluster, on one
local Ray cluster shared by the module: 1P+1D and fused give the offline
engine's greedy tokens, P ships each prompt's latent pages (bytes: pages x
the latent page), and a P killed while it holds writes loses nothing: D
prefills those requests itself and every engine ends idle."""

import threading
import time

import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.client import Client

from support.deployed import by_name, deployed
from support.moe import deepseek_v3_checkpoint
from support.checkpoints import build_tokenizer, save_tokenizer

pytest.importorskip("transformers")

ENGINE = {"page_size": 4, "total_pages": 160, "max_scheduled_tokens": 16, "max_batch_size": 8}
OPTIONS = {"transfer_timeout_s": 3.0, "lease_s": 3.0, "heartbeat_s": 0.5}
PROMPTS = ["The quick brown fox jumps over the lazy dog. Pages, tickets and leases: "
           "nothing leaks when a transfer fails.",
           "Disaggregated prefill moves the KV cache from one engine to another.",
           "A decode engine recovers locally when its prefill peer dies."]
TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = build_tokenizer()
    d = tmp_path_factory.mktemp("dsv3-cluster")
    deepseek_v3_checkpoint(d, vocab_size=tok.get_vocab_size())
    save_tokenizer(tok, d)
    return d


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM({"model": {"path": str(checkpoint), "dtype": "float32"}}, **ENGINE)
    sp = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return {p: o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, sp, use_tqdm=False))}, \
        [len(llm.tokenizer.encode(p)) for p in PROMPTS]


@pytest.fixture(scope="module")
def deployment(checkpoint):
    cfg = {"model": {"path": str(checkpoint), "dtype": "float32"}, "engine": ENGINE,
           "cluster": {"prefill": 1, "decode": 1, "fused": 1}}
    with deployed(cfg, engine_options=OPTIONS) as dep:
        yield dep


@pytest.fixture
def client(deployment):
    c = Client(deployment.address, timeout=120)
    yield c
    c.close()


def test_pd_and_fused_give_the_offline_engine_s_tokens_moving_latent_pages(client, reference):
    want, lens = reference
    before = by_name(client)["prefill-0"]
    for route in ("fused", "disaggregated"):
        got = {p: client.generate(p, max_tokens=TOKENS, route=route, ignore_eos=True).token_ids
               for p in PROMPTS}
        assert got == want, route
    p = by_name(client)["prefill-0"]
    (latent,) = p["cache_groups"]
    assert latent["page_bytes"] == 3 * 4 * (32 + 8) * 4        # layers x tokens x entry x fp32
    assert p["transfers"] - before["transfers"] == len(PROMPTS)
    assert p["transfer_bytes"] - before["transfer_bytes"] == \
        sum(-(-n // 4) for n in lens) * latent["page_bytes"]


@pytest.mark.chaos
@pytest.mark.slow           # a killed engine's restart
def test_p_killed_while_it_holds_writes_loses_nothing(deployment, client, reference):
    from test_chaos import assert_all_idle, set_faults, set_faults_after_restart

    want, _ = reference
    set_faults(deployment, "prefill", [{"stage": "post", "action": "delay", "delay_s": 3.0,
                                        "times": 0}])
    out, errs = {}, []

    def one(p):
        try:
            out[p] = client.generate(p, max_tokens=TOKENS, route="disaggregated",
                                     ignore_eos=True).token_ids
        except Exception as e:          # reported below
            errs.append(e)
    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while not ray.get(deployment.actor("prefill-0").check.remote())["requests"]:
        assert time.monotonic() < deadline, "P never held the requests"
        time.sleep(0.05)                # polling for a state, not waiting out a race
    ray.kill(deployment.actor("prefill-0"), no_restart=False)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a request hung"
    assert not errs, errs
    assert out == want
    set_faults_after_restart(deployment)
    assert_all_idle(deployment)
