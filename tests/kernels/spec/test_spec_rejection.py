"""Speculative proposals and their verification (kernels/spec/proposers.py,
kernels/spec/rejection.py): lookup finds what followed, greedy verify is exact,
and sampled verify follows the target's distribution."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels.spec.proposers import DraftAsk, NgramProposer, lookup
from pdserve.kernels.spec.rejection import VerifyRow, verify
from pdserve.kernels.sampling import row_uniform, sample
from pdserve.text.sampling_params import SamplingParams

# chi-squared critical values at p = 0.001, by degrees of freedom
CHI2_999 = {4: 18.47, 7: 24.32}


def test_lookup_proposes_what_followed_the_latest_match():
    ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(ctx, 1, 3, 2) == [7, 8]            # the latest earlier [1, 2, 3]
    assert lookup(ctx, 1, 3, 10) == [7, 8, 5, 1, 2, 3]   # up to the end of the context


def test_lookup_prefers_the_longest_suffix_and_respects_the_minimum():
    ctx = [4, 5, 6, 1, 5, 6, 2, 5, 6]
    # the 3-gram [2, 5, 6] never occurred before; the 2-gram [5, 6] last did at 4
    assert lookup(ctx, 2, 3, 1) == [2]
    assert lookup([1, 2, 3, 4], 1, 3, 2) == []       # nothing repeats
    assert lookup([7, 3, 7], 2, 3, 2) == []          # a 1-gram match is below the minimum
    assert lookup([7, 3, 7], 1, 3, 2) == [3, 7]


def test_ngram_proposer_answers_each_ask_within_its_k():
    prop = NgramProposer(1, 2)
    out = prop.propose([DraftAsk("a", [1, 2, 1], 1), DraftAsk("b", [5, 6], 3)])
    assert [d.tokens for d in out] == [[2], []]
    assert all(d.probs is None for d in out)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)


def test_greedy_verify_keeps_candidates_while_they_equal_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 11)
    best = logits.argmax(-1).tolist()
    g = SamplingParams(temperature=0)
    wrong = (best[1] + 1) % 11
    out = verify(logits, [VerifyRow([best[0], wrong, 3], g, 0, 0)])
    assert out == [[best[0], best[1]]]                # one accepted, then the correction
    out = verify(logits, [VerifyRow(best[:3], g, 0, 0)])
    assert out == [best]                              # all accepted, then the bonus


def test_verify_with_no_candidates_is_a_plain_sample():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    sp = SamplingParams(temperature=0.8, top_k=20, seed=7)
    rows = [VerifyRow([], sp, 7, s) for s in (0, 5, 9)]
    got = [t for r in verify(logits, rows) for t in r]
    want, _ = sample(logits, [sp] * 3, [0, 5, 9], [7] * 3)
    assert got == want


def test_a_drafter_equal_to_the_target_accepts_every_candidate():
    """A drafter that samples from exactly the target's distribution (q = p)
    has every candidate accepted, whatever it drew."""
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    sp = SamplingParams(temperature=1.0)
    p = torch.softmax(logits.double(), -1)
    for seed in range(50):
        drafts = [int(torch.multinomial(p[j], 1, generator=torch.Generator().manual_seed(
            seed * 10 + j))) for j in range(3)]
        out = verify(logits, [VerifyRow(drafts, sp, seed, 0, p[:3].float())])[0]
        assert out[:3] == drafts and len(out) == 4


def _chi2(counts, probs, n):
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs))


@pytest.mark.parametrize("drafter", ["point-mass", "probabilistic"])
def test_sampled_verify_follows_the_target_distribution(drafter):
    """Over many seeded draws on a 5-token vocabulary, the first token a
    verify gives is distributed as the target's p (chi-squared at p=0.001),
    for a fixed point-mass candidate and for a drafter sampling from a q
    far from p; the second token, given the first, too."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0], [0.3, 1.5, -1.0, 0.0, 0.4]])
    p = torch.softmax(logits.double(), -1)
    q = torch.softmax(torch.tensor([[2.0, -1.0, 1.0, -2.0, 0.5]] * 2).double(), -1)
    sp = SamplingParams(temperature=1.0)
    n = 6000
    rows = []
    for seed in range(n):
        if drafter == "point-mass":
            rows.append(VerifyRow([0, 1], sp, seed, 0))
        else:
            u = [row_uniform(seed + 10 ** 6, j) for j in range(2)]
            d = [int(torch.searchsorted(q[j].cumsum(0), torch.tensor(u[j], dtype=torch.float64)))
                 for j in range(2)]
            rows.append(VerifyRow(d, sp, seed, 0, q.float()))
    out = verify(_rows(logits, rows), rows)
    first = [0] * 5
    for o in out:
        first[o[0]] += 1
    assert _chi2(first, p[0].tolist(), n) < CHI2_999[4], first
    # the second token, among draws whose first was the candidate 0 (point
    # mass) or any (probabilistic, then its row is the same p[1])
    second = [0] * 5
    for o in out:
        if len(o) > 1:
            second[o[1]] += 1
    m = sum(second)
    assert m > 300
    assert _chi2(second, p[1].tolist(), m) < CHI2_999[4], second


def _rows(logits, rows):
    """Each request's 1 + len(drafts) rows: the target's rows in order, the
    last repeated for the bonus."""
    out = []
    for r in rows:
        out += [logits[min(j, len(logits) - 1)] for j in range(1 + len(r.drafts))]
    return torch.stack(out)


def test_acceptance_rate_of_a_point_mass_is_the_target_probability():
    logits = torch.tensor([[0.0, math.log(3.0), 0.0, 0.0]])   # p(1) = 1/2
    sp = SamplingParams(temperature=1.0)
    n = 4000
    rows = [VerifyRow([1], sp, s, 0) for s in range(n)]
    out = verify(logits.repeat(2 * n, 1), rows)
    accepted = sum(1 for o in out if len(o) == 2)
    assert abs(accepted / n - 0.5) < 0.04
    # a rejection never gives the candidate itself
    assert all(o[0] != 1 for o in out if len(o) == 1)
