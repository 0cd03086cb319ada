"""A sliding-window model (Gemma 3, window 8) through the cluster, on one
local Ray cluster shared by the module: P/D and fused give the offline
engine's greedy tokens, P moves only the sliding group's last window, and
the stats report each cache group, with the pages a long request holds on
the sliding group bounded by window + chunk while its history grows."""

import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.client import Client
from pdserve.scheduler.capacity import sliding_request_pages
from pdserve.scheduler.config import EngineConfig

from support.deployed import by_name, deployed
from support.checkpoints import build_tokenizer, save_tokenizer
from support.checkpoints import WINDOW, gemma3_checkpoint

ENGINE = {"page_size": 4, "total_pages": 160, "sliding_pages": 48,
          "max_scheduled_tokens": 16, "max_batch_size": 8}
PROMPTS = ["The quick brown fox jumps over the lazy dog. Pages, tickets and leases: "
           "nothing leaks when a transfer fails.",
           "Disaggregated prefill moves the KV cache from one engine to another.",
           "A decode engine recovers locally when its prefill peer dies. The quick brown fox"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = build_tokenizer()
    _, d = gemma3_checkpoint(tmp_path_factory.mktemp("gemma-cluster"),
                             vocab_size=tok.get_vocab_size())
    save_tokenizer(tok, d)
    return d


@pytest.fixture(scope="module")
def deployment(checkpoint):
    cfg = {"model": {"path": str(checkpoint), "dtype": "float32"},
           "engine": ENGINE,
           "cluster": {"prefill": 1, "decode": 1, "fused": 1}}
    with deployed(cfg, engine_options={"transfer_timeout_s": 20.0}) as dep:
        yield dep


@pytest.fixture
def client(deployment):
    c = Client(deployment.address, timeout=120)
    yield c
    c.close()


def test_pd_and_fused_give_the_offline_engine_s_greedy_tokens(checkpoint, client):
    llm = LLM({"model": {"path": str(checkpoint), "dtype": "float32"}}, **ENGINE)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    before = by_name(client)["prefill-0"]["transfer_bytes"]
    for route in ("fused", "disaggregated"):
        got = [client.generate(p, max_tokens=12, route=route, ignore_eos=True).token_ids
               for p in PROMPTS]
        assert got == want, route
    # P sent every prompt's missing full-history pages, but of the sliding
    # group only the pages D's first decode reads
    p = by_name(client)["prefill-0"]
    full, slide = p["cache_groups"]
    assert (full["retention"], slide["retention"], slide["window"]) == \
        ("full_history", "sliding_window", WINDOW)
    lens = [len(llm.tokenizer.encode(t)) for t in PROMPTS]
    window_pages = [-(-n // 4) - (n - WINDOW + 1) // 4 for n in lens]
    most = sum(-(-n // 4) for n in lens) * full["page_bytes"] + \
        sum(window_pages) * slide["page_bytes"]
    assert 0 < p["transfer_bytes"] - before <= most


def test_stats_count_each_group_and_a_long_request_holds_only_its_window(client):
    info = client.server_info()
    assert all(e["kv_capacity_tokens"] == 160 * 4 for e in info["engines"])
    bound = sliding_request_pages(EngineConfig(**ENGINE), WINDOW, ENGINE["max_scheduled_tokens"])
    seen = []
    for i, chunk in enumerate(client.generate_stream(PROMPTS[0], max_tokens=300,
                                                     route="fused", ignore_eos=True)):
        if i % 25 == 0:
            full, slide = by_name(client)["fused-0"]["cache_groups"]
            seen.append((full["used_pages"], slide["used_pages"]))
    assert len(seen) >= 8
    # the history grows past anything a window holds, the window does not
    assert seen[-1][0] > 3 * bound
    assert all(0 < s <= bound for _, s in seen), seen
    deadline = time.monotonic() + 30
    while any(g["used_pages"] for g in by_name(client)["fused-0"]["cache_groups"]):
        assert time.monotonic() < deadline, "the request's pages were not let go"
