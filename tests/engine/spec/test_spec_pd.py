"""Speculative decoding across a P/D pair (spec §3.1): P proposes candidates
after the first token of the completing forward and ships them with it; D
verifies them in its first decode round. Two real executors on the tiny
model, their planners wired in-process and the KV copied page by page (what
a transport does), so greedy tokens can be held against fused decoding at
every prompt length modulo the page size, with and without a prefix hit;
and the handshake refuses peers that speculate differently."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.proto import control_pb2 as pb
from pdserve.engine.local_pair import LocalPair
from pdserve.scheduler import EngineConfig, RejectedRequest

from support.engine_fakes import server

PS = 4
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "gate": False}
BASE = [5, 17, 42, 9, 3, 77, 12, 8]
LENGTHS = (20, 21, 23, 24, 25, 27)     # 0, 1 and page - 1 modulo the page, twice


def make_prompts(llm) -> list:
    """Prompts that end inside the tiny model's own continuation of BASE,
    which loops, so the first token is one lookup finds in the prompt:
    one of each length class modulo the page size."""
    seed = BASE * 2
    gen = llm.generate([seed], greedy(16), use_tqdm=False)[0].token_ids
    return [(seed + gen)[:n] for n in LENGTHS]


def greedy(n=16):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


class RealPD(LocalPair):
    """engine/local_pair.py's pair, checking at each D round that a request
    landed with P's candidates verifies them in its first decode."""

    def __init__(self, llm: LLM, **engine):
        kw = dict(page_size=PS, total_pages=128, max_scheduled_tokens=32,
                  max_context_tokens=512, speculative=SPEC)
        super().__init__(llm.model, llm.tokenizer, EngineConfig(**(kw | engine)))
        self.first_verifies = 0       # D's first decodes that verified P's candidates
        build = self.D.build

        def checked_build():
            plan = build()
            for rid, drafts in self.landed:
                if drafts and rid in self.D.requests:
                    carried = plan.verify.get(rid, [])
                    assert carried and carried == drafts[:len(carried)], (rid, carried, drafts)
                    self.first_verifies += 1
            self.landed = []
            return plan
        self.D.build = checked_build     # type: ignore[method-assign]

    def generate(self, prompts, sp) -> list:
        out = super().generate(prompts, sp)
        self.D.assert_idle()
        self.P.assert_idle()
        return out

    def tick(self) -> list:
        out = super().tick()
        self.D.check_invariants()
        self.P.check_invariants()
        return out


@pytest.fixture(scope="module")
def llm():
    return LLM(page_size=PS)


@pytest.fixture(scope="module")
def prompts(llm):
    return make_prompts(llm)


@pytest.fixture(scope="module")
def reference(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]


def test_p_ships_candidates_and_d_verifies_them_to_the_fused_tokens(llm, prompts, reference):
    pd = RealPD(llm)
    assert pd.generate(prompts, greedy()) == reference
    c = pd.dx.spec.counts
    assert pd.shipped_drafts > 0            # P proposed after its first token
    assert pd.first_verifies > 0            # ... and D's first decode verified them
    assert c.drafts > 0 and c.accepted_tokens > 0
    assert pd.px.spec.counts.drafts == 0    # P verifies nothing: it decodes nothing


def test_a_prefix_hit_on_d_changes_nothing(llm, prompts, reference):
    pd = RealPD(llm)
    assert pd.generate(prompts, greedy()) == reference
    before = len(pd.first_pages)
    assert pd.generate(prompts, greedy()) == reference
    assert any(fp > 0 for fp in pd.first_pages[before:])   # D held a prefix: P sent the rest


def test_chunked_prompts_on_p_ship_the_same_candidates(llm, prompts, reference):
    pd = RealPD(llm, max_scheduled_tokens=8)
    assert pd.generate(prompts, greedy()) == reference


def test_peers_that_speculate_differently_are_refused_when_they_meet():
    s = server("decode", "decode-0", "prefill-0")
    theirs = "method=ngram num_speculative_tokens=3 prompt_lookup_min=2 prompt_lookup_max=4"
    with pytest.raises(RejectedRequest) as e:
        s.peer.add_peer(pb.AddPeerRequest(engine="prefill-1", incarnation=1, address="x:0",
                                          nixl_metadata=b"prefill-1@1", spec_config=theirs))
    msg = str(e.value)
    assert "decode-0 has speculative off" in msg and f"prefill-1 has {theirs}" in msg
    assert "prefill-1" not in s.peer.peers
