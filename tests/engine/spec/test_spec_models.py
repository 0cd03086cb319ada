"""Speculative decoding on the other cache layouts: a sliding-window model
(Gemma 3) keeps its window exactly across verifies, and the families whose
state a rejected candidate would leave advanced are refused by name."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams

from support.checkpoints import gemma3_checkpoint
from support.checkpoints import lfm2_checkpoint

transformers = pytest.importorskip("transformers")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "gate": False}


def prompts():
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 128, (14,), generator=g).tolist()
    return [base * 3, base[:9] * 4 + [5], base[3:] + base[:12]]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return gemma3_checkpoint(tmp_path_factory.mktemp("spec-gemma"))[1]


def serve(d, **engine):
    base = dict(page_size=4, total_pages=96, sliding_pages=64, max_scheduled_tokens=16,
                max_batch_size=8)
    base.update(engine)
    return LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", **base)


def greedy(llm, n=16):
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts(), sp, use_tqdm=False)]


@pytest.mark.parametrize("engine", [{}, {"total_pages": 30, "sliding_pages": 40,
                                         "safe_steps": 1}])
def test_a_sliding_model_verifies_to_the_tokens_of_plain_decoding(gemma, engine):
    want = greedy(serve(gemma, **engine))
    llm = serve(gemma, speculative=SPEC, **engine)
    assert greedy(llm) == want
    assert llm.executor.spec.counts.drafts > 0
    llm.engine.planner.assert_idle()


def test_a_state_model_is_refused_for_speculation_by_name(tmp_path):
    _, d = lfm2_checkpoint(tmp_path / "lfm2")
    with pytest.raises(ValueError, match="lfm2 keeps a recurrent state per sequence"):
        LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch",
            speculative=SPEC)
