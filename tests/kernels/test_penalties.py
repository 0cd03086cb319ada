"""Penalties, min-p and logit bias (kernels/sampling.py): the logits a row
samples from, against transformers' logits processors where it has them
and the OpenAI formula where it does not; the parameters' checks; and the
offline engine generating with them."""

import math

import pytest
import torch

from pdserve.kernels.sampling import _penalize, sample
from pdserve.text.sampling_params import SamplingParams
from pdserve.engine.executor.tracked import Tracked, penalty_history

VOCAB = 50


def rows(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 3


def openai_penalties(logits, output, presence, frequency):
    """OpenAI's formula, token by token."""
    out = logits.clone()
    for t in set(output):
        out[t] -= output.count(t) * frequency + presence
    return out


def test_presence_and_frequency_penalties_follow_openai_s_formula():
    x = rows(3)
    hist = [([1, 2, 3], [4, 4, 4, 7]), ([], [9]), ([5], [])]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.75),
              SamplingParams(presence_penalty=-1.0),
              SamplingParams(frequency_penalty=2.0)]
    got = _penalize(x, params, hist)
    for i, (sp, (_, output)) in enumerate(zip(params, hist)):
        want = openai_penalties(x[i], output, sp.presence_penalty, sp.frequency_penalty)
        assert torch.allclose(got[i], want), i
    assert torch.equal(got[2], x[2])            # nothing generated yet: nothing to penalize


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    tf = pytest.importorskip("transformers")
    x = rows(2, seed=1)
    hist = [([1, 2, 3, 3], [10, 11]), ([40, 41], [2, 40])]
    for penalty in (1.3, 0.8):
        got = _penalize(x, [SamplingParams(repetition_penalty=penalty)] * 2, hist)
        proc = tf.RepetitionPenaltyLogitsProcessor(penalty)
        for i, (prompt, output) in enumerate(hist):
            want = proc(torch.tensor([prompt + output]), x[i:i + 1].clone())[0]
            assert torch.allclose(got[i], want), (penalty, i)


def test_logit_bias_is_added_and_steers_greedy_and_sampled_rows():
    x = rows(2)
    sp = SamplingParams(temperature=0.0, logit_bias={7: 100.0, 3: -5.0})
    got = _penalize(x, [sp, SamplingParams()], [((), ()), None])
    assert got[0, 7] == x[0, 7] + 100 and got[0, 3] == x[0, 3] - 5
    assert torch.equal(got[1], x[1]) and torch.equal(x, rows(2))     # the raw rows untouched
    tokens, lps = sample(x, [sp, SamplingParams(seed=3, logit_bias={(11): 100.0}, logprobs=0)],
                         [0, 0], [0, 0], histories=[((), ()), ((), ())])
    assert tokens == [7, 11]
    # logprobs are the model's own, before the bias
    assert math.isclose(lps[1].logprob, torch.log_softmax(x[1], -1)[11].item(), rel_tol=1e-5)


def test_penalties_keep_a_row_s_token_whatever_its_batch():
    x = rows(6, seed=2)
    params = [SamplingParams(seed=s, frequency_penalty=1.0, repetition_penalty=1.2,
                             min_p=0.05) if s % 2 else SamplingParams(seed=s, top_p=0.9)
              for s in range(6)]
    hist = [([s, s + 1], [s + 2] * s) for s in range(6)]
    batch, _ = sample(x, params, [3] * 6, [0] * 6, histories=hist)
    for i in range(6):
        alone, _ = sample(x[i:i + 1], params[i:i + 1], [3], [0], histories=hist[i:i + 1])
        assert alone == [batch[i]], i


def test_min_p_drops_what_transformers_drops_and_keeps_the_likeliest():
    tf = pytest.importorskip("transformers")
    x = rows(4, seed=3)
    for min_p in (0.05, 0.3, 1.0):
        keep = ~torch.isinf(tf.MinPLogitsWarper(min_p)(None, x.clone()))
        drawn = set()
        for seed in range(300):
            t, _ = sample(x, [SamplingParams(seed=seed, min_p=min_p)] * 4, [0] * 4, [0] * 4)
            drawn |= {(i, tok) for i, tok in enumerate(t)}
        assert all(keep[i, tok] for i, tok in drawn), min_p
        if min_p == 1.0:          # only the likeliest token is left
            assert drawn == {(i, int(x[i].argmax())) for i in range(4)}


def test_a_min_p_below_float32_s_range_keeps_every_token_and_draws_no_nan():
    x = torch.full((1, 600), -1e4)
    x[0, :3] = torch.tensor([2.0, 1.0, 0.0])       # the rest underflows to weight 0
    drawn = {sample(x, [SamplingParams(seed=s, min_p=1e-40)], [0], [0])[0][0]
             for s in range(200)}
    assert drawn == {0, 1, 2}


def test_a_penalized_row_without_its_history_is_refused():
    with pytest.raises(ValueError, match="histories"):
        sample(rows(1), [SamplingParams(presence_penalty=1.0)], [0], [0])


@pytest.mark.parametrize("kw, words", [
    ({"presence_penalty": 2.5}, "presence_penalty=2.5 is invalid: give a number in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.001}, "repetition_penalty=0.001 is invalid"),
    ({"min_p": 1.5}, "min_p=1.5 is invalid"),
    ({"logit_bias": (5,)}, "give {token id: bias}"),
    ({"logit_bias": {-1: 1.0}}, "token id -1 is not an integer >= 0"),
    ({"logit_bias": {5: 101}}, "the bias 101 of token 5"),
    ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "name each token id once"),
    ({"logit_bias": "5"}, "give {token id: bias}"),
])
def test_bad_parameters_name_the_field_and_what_to_give(kw, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert words in str(e.value)


def test_a_resubmitted_request_s_earlier_output_counts_as_output():
    class Req:
        def __init__(self, prompt, output):
            self.prompt = type("P", (), {"tokens": prompt})()
            self.output = output

    sp = SamplingParams(frequency_penalty=1.0)
    fresh = penalty_history(Req([1, 2, 3], [4, 4, 5]), Tracked(sp, 0, None))
    again = penalty_history(Req([1, 2, 3, 4, 4], [5]), Tracked(sp, 0, None, prior=2))
    assert fresh == again == ((), [4, 4, 5])        # only the repetition penalty reads the prompt
    sp = SamplingParams(repetition_penalty=1.5)
    again = penalty_history(Req([3, 1, 3, 2, 4, 4], [5]), Tracked(sp, 0, None, prior=2))
    assert again[0].tolist() == [1, 2, 3] and again[1] == [4, 4, 5]


def test_the_offline_engine_generates_with_penalties_and_refuses_a_bias_past_the_vocab():
    from pdserve import LLM

    llm = LLM({"model": {"preset": "tiny"}})
    prompt = [5, 6, 7, 8]
    plain = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    spread = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                 frequency_penalty=2.0, presence_penalty=2.0),
                          use_tqdm=False)[0].token_ids
    assert len(set(spread)) > len(set(plain)), (plain, spread)
    forced = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                 logit_bias={3: 100.0}),
                          use_tqdm=False)[0].token_ids
    assert forced == [3] * 5
    vocab = llm.model.cfg.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab}, outside the model's vocabulary"):
        llm.generate(prompt, SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)


def test_a_resubmitted_seeded_request_goes_on_as_if_it_had_not_been():
    """What the router does when an engine is lost mid-stream: the prompt
    plus the tokens streamed, `prior_output` saying how many those are. A
    seeded, penalized request then continues with the tokens the
    uninterrupted run gave (its draws and its penalties pick up where they
    left off)."""
    from pdserve import LLM

    llm = LLM({"model": {"preset": "tiny"}})
    prompt, k = [5, 6, 7, 8], 5
    kw = dict(temperature=1.0, seed=11, ignore_eos=True, frequency_penalty=1.0,
              presence_penalty=0.5, repetition_penalty=1.3)
    whole = llm.generate(prompt, SamplingParams(max_tokens=12, **kw),
                         use_tqdm=False)[0].token_ids
    register = llm.executor.register

    def resubmitted(req_id, params, fallback_seed, prompt=()):
        register(req_id, params, fallback_seed, prompt, prior_output=k)
    llm.executor.register = resubmitted
    rest = llm.generate(prompt + whole[:k], SamplingParams(max_tokens=12 - k, **kw),
                        use_tqdm=False)[0].token_ids
    assert rest == whole[k:]
