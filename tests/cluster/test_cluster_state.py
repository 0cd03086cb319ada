"""A hybrid state model (Qwen3.5, Gated DeltaNet beside full attention)
through the cluster, on one local Ray cluster shared by the module: P/D
and fused give the offline engine's greedy tokens, P ships the final state
as one slot beside the K/V pages (spec §1.2: an endpoint-only landing),
and D's prefix cache serves the next turn of a conversation in P/D as the
fused engine's does."""

import pytest

from pdserve import LLM, SamplingParams
from pdserve.client import Client

from support.deployed import by_name, deployed
from support.checkpoints import build_tokenizer, save_tokenizer
from support.checkpoints import qwen3_5_checkpoint

pytest.importorskip("transformers")

ENGINE = {"page_size": 4, "total_pages": 160, "max_scheduled_tokens": 16,
          "max_batch_size": 8, "state_block": 8}
PROMPTS = ["The quick brown fox jumps over the lazy dog. Pages, tickets and leases: "
           "nothing leaks when a transfer fails.",
           "Disaggregated prefill moves the KV cache from one engine to another.",
           "A decode engine recovers locally when its prefill peer dies. The quick brown fox"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = build_tokenizer()
    d = tmp_path_factory.mktemp("qwen-cluster")
    qwen3_5_checkpoint(d, vocab_size=tok.get_vocab_size())
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
    before = by_name(client)["prefill-0"]
    for route in ("fused", "disaggregated"):
        got = [client.generate(p, max_tokens=12, route=route, ignore_eos=True).token_ids
               for p in PROMPTS]
        assert got == want, route
    p = by_name(client)["prefill-0"]
    full, state = p["cache_groups"]
    assert (full["retention"], state["retention"]) == ("full_history", "snapshot_state")
    # every prompt moved its K/V pages and exactly one state slot
    lens = [len(llm.tokenizer.encode(t)) for t in PROMPTS]
    sent = p["transfer_bytes"] - before["transfer_bytes"]
    assert p["transfers"] - before["transfers"] == len(PROMPTS)
    assert sent == sum(-(-n // 4) for n in lens) * full["page_bytes"] + \
        len(PROMPTS) * state["page_bytes"]


def test_the_next_turn_hits_d_s_cache_in_pd_as_it_hits_fused(client):
    """A conversation's second turn repeats the first turn's prompt and
    answer. Fused resumes it at its last checkpoint; D, which decoded the
    answer, finds at least as much of it cached, so P ships only the pages
    past D's hit and the final state."""
    first = PROMPTS[2]
    hits = {}
    for route, engine in (("fused", "fused-0"), ("disaggregated", "decode-0")):
        answer = client.generate(first, max_tokens=8, route=route, ignore_eos=True).text
        before = by_name(client)
        got = client.generate(first + answer + " And then?", max_tokens=4, route=route,
                              ignore_eos=True)
        after = by_name(client)
        assert len(got.token_ids) == 4
        hits[route] = after[engine]["prefix_hits"] - before[engine]["prefix_hits"]
        queried = after[engine]["prefix_queries"] - before[engine]["prefix_queries"]
        if route == "disaggregated":
            p0, p1 = before["prefill-0"], after["prefill-0"]
            full, state = p1["cache_groups"]
            pages = -(-queried // 4) - hits[route] // 4
            assert p1["transfer_bytes"] - p0["transfer_bytes"] == \
                pages * full["page_bytes"] + state["page_bytes"]
    # fused resumed at a checkpoint (a multiple of the 8-token block), D no earlier
    assert hits["disaggregated"] >= hits["fused"] >= 8 and hits["fused"] % 8 == 0
