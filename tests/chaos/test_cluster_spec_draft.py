"""A 1P+1D deployment on Ray speculating with a draft model (the tiny
preset drafting for itself, gate off): P drafts on the completing forward
and ships the candidates, D verifies them and drafts its own after; the
tokens are those of plain decoding, every candidate is accepted, and every
engine ends idle."""

import pytest

from pdserve import LLM, SamplingParams
from pdserve.client import Client

from support.deployed import by_name, deployed
from test_chaos import IDLE_BOUND_S, assert_all_idle

pytestmark = [pytest.mark.slow]

ENGINE = {"page_size": 16, "total_pages": 256, "max_scheduled_tokens": 64,
          "max_batch_size": 16}
SPEC = {"method": "draft", "num_speculative_tokens": 3, "draft_model": {"preset": "tiny"},
        "gate": False}
PROMPTS = ["draft a draft", "the same model twice", "spec spec spec"]
N = 16


def test_p_d_with_a_draft_model_gives_the_tokens_of_plain_decoding():
    sp = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(**ENGINE).generate(PROMPTS, sp, use_tqdm=False)]
    cfg = {"engine": ENGINE, "speculative": SPEC,
           "cluster": {"prefill": 1, "decode": 1, "fused": 0}}
    with deployed(cfg) as dep:
        c = Client(dep.address, timeout=120)
        try:
            got = [c.generate(p, max_tokens=N, ignore_eos=True).token_ids for p in PROMPTS]
            assert got == want
            d = next(s for n, s in by_name(c).items() if n.startswith("decode"))
            spec = d["spec_decode"]
            assert spec["num_drafts"] > 0
            assert spec["num_accepted_tokens"] == spec["num_draft_tokens"]
            assert_all_idle(dep, IDLE_BOUND_S)
        finally:
            c.close()
