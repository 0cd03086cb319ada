"""Speculative decoding in the fused engine (engine/spec/speculation.py,
scheduler/speculation.py): a verify row scores the last token and its
candidates in one forward, and greedy tokens are those plain decoding
gives, whatever the chunking, prefix hits, retraction or overlap."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.scheduler import ConfigError, EngineConfig

# repetitive prompts, so that prompt lookup finds candidates
PROMPTS = [[5, 17, 42, 9, 3, 77, 12, 8, 5, 17, 42, 9, 3, 77, 12, 8, 5, 17],
           [5, 17, 42, 9, 3, 77, 12, 8, 90, 91, 4],
           list(range(1, 30)) + list(range(1, 12)),
           [94, 3, 94, 3, 94]]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "gate": False}


def greedy(n=24, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM().generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.mark.parametrize("engine", [
    {},
    {"max_scheduled_tokens": 16},                                    # chunked prompts
    {"max_scheduled_tokens": 8, "page_size": 4},                     # budgets cut verify rows
    {"enable_mixed_prefill_decode": False},
    {"page_size": 4, "total_pages": 24, "safe_steps": 4},            # retraction
    {"page_size": 4, "total_pages": 24, "safe_steps": 4, "host_pages": 64},
    {"overlap": True},
])
def test_greedy_tokens_are_identical_with_speculation_on_and_off(reference, engine):
    llm = LLM(speculative=SPEC, **engine)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    counts = llm.executor.spec.counts
    assert counts.drafts > 0 and counts.accepted_tokens > 0
    llm.engine.planner.assert_idle()


def test_prefix_hits_verify_the_same_tokens(reference):
    """The second pass finds every prompt cached; what it generates does
    not change, and rejected candidates never entered the prefix index
    (else the second pass would read their K/V)."""
    llm = LLM(speculative=SPEC, page_size=4)
    first = [o.token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(
        [p + t[:9] for p, t in zip(PROMPTS, first)], greedy(8), use_tqdm=False)]
    assert first == reference
    assert again == [t[9:17] for t in reference]
    assert llm.engine.planner.hits.device_tokens > 0
    llm.engine.planner.assert_idle()


def test_a_stop_token_inside_an_accepted_block_ends_the_request_there(reference):
    stop = reference[0][6]
    sp = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop])
    off = LLM().generate(PROMPTS, sp, use_tqdm=False)
    on = LLM(speculative=SPEC).generate(PROMPTS, sp, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in on] == \
        [(o.token_ids, o.text, o.finish_reason) for o in off]


def test_max_tokens_is_never_exceeded_by_a_verify():
    for n in (1, 3):
        outs = LLM(speculative=SPEC).generate(PROMPTS, greedy(n), use_tqdm=False)
        assert all(len(o.token_ids) == n for o in outs)


def test_a_seeded_request_gives_the_same_tokens_in_any_batch():
    sp = SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True)
    llm = LLM(speculative=SPEC)
    alone = llm.generate([PROMPTS[0]], sp, use_tqdm=False)[0].token_ids
    batched = llm.generate(PROMPTS, sp, use_tqdm=False)[0].token_ids
    assert alone == batched


def test_requests_with_penalties_or_logprobs_decode_without_candidates(reference):
    llm = LLM(speculative=SPEC)
    outs = llm.generate(PROMPTS, greedy(logprobs=2), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert llm.executor.spec.counts.drafts == 0


def test_speculative_settings_are_validated_with_the_key_and_the_fix():
    cfg = EngineConfig.from_dict({"speculative": {"method": "ngram",
                                                  "num_speculative_tokens": 4}})
    assert cfg.decode_input_tokens == 5
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer in"):
        EngineConfig(speculative={"num_speculative_tokens": 0})
    with pytest.raises(ConfigError, match="method is 'eagle9', which does not exist"):
        EngineConfig(speculative={"method": "eagle9"})
    with pytest.raises(ConfigError, match="unknown key engine.speculative.prompt_lookup"):
        EngineConfig(speculative={"prompt_lookup": 3})
    with pytest.raises(ConfigError, match="prompt_lookup_min=5 exceeds"):
        EngineConfig(speculative={"prompt_lookup_min": 5, "prompt_lookup_max": 2})
    with pytest.raises(ConfigError, match="decode_input_tokens=2 does not match"):
        EngineConfig(decode_input_tokens=2, speculative={"num_speculative_tokens": 3})


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 30.0)])
def test_batched_verify_attention_equals_each_row_as_a_chunk(window, softcap):
    """The torch backend batches verify rows (BatchMeta.num_verifies) as it
    does decodes; every row's output equals the per-sequence chunk path's."""
    import torch

    from pdserve.kernels.attention import BatchMeta, SeqMeta, TorchAttention

    torch.manual_seed(0)
    ps, h, kvh, d = 4, 4, 2, 8
    att = TorchAttention(h, kvh, d, sliding_window=window, softcap=softcap)
    pages_k, pages_v = torch.randn(40, ps, kvh, d), torch.randn(40, ps, kvh, d)
    # (history before the rows, rows): verify rows of 1 + k, and a plain decode
    shapes = [(9, 4), (2, 2), (17, 3), (12, 1)]
    seqs, slots, at, page = [], [], 0, 0
    for hist, m in shapes:
        n = -(-(hist + m) // ps)
        table = list(range(page, page + n))
        page += n
        lo = max(hist - window + 1, 0) if window else 0
        seqs.append(SeqMeta(at, m, hist + m, table, lo))
        slots += [table[p // ps] * ps + p % ps for p in range(hist, hist + m)]
        at += m
    q, k, v = torch.randn(at, h, d), torch.randn(at, kvh, d), torch.randn(at, kvh, d)
    pos = torch.tensor([p for hist, m in shapes for p in range(hist, hist + m)])
    outs = []
    for nv in (0, 3):
        meta = BatchMeta(list(seqs), torch.tensor(slots), pos, num_decodes=1, window=window,
                         num_verifies=nv)
        outs.append(att.forward(q, k, v, pages_k.clone(), pages_v.clone(), meta))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
