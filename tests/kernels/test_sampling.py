"""Batched sampling (kernels/sampling.py): one token per row, keyed by
(seed, step) alone, drawn from the distribution temperature, top-k and
top-p leave."""

import math

import torch

from pdserve.kernels.sampling import BLOCK, TOP_P_CANDIDATES, row_uniform, sample
from pdserve.text.sampling_params import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]
N = 4000


def draws(sp_kw: dict, probs=PROBS, n=N) -> list[float]:
    """Token frequencies of n seeded rows over one distribution."""
    logits = torch.tensor(probs).log().repeat(n, 1)
    params = [SamplingParams(seed=s, **sp_kw) for s in range(n)]
    tokens, _ = sample(logits, params, [0] * n, [0] * n)
    return (torch.bincount(torch.tensor(tokens), minlength=len(probs)) / n).tolist()


def close(freqs, want, n=N) -> bool:
    """Every frequency within 4.5 standard errors of what it should be."""
    return all(abs(f - p) <= 4.5 * math.sqrt(max(p * (1 - p), 1e-12) / n)
               for f, p in zip(freqs, want))


def test_a_row_s_token_does_not_depend_on_its_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(24, 500) * 2
    kinds = [dict(temperature=0), dict(temperature=0.7), dict(temperature=1.0, top_k=20),
             dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=100, top_p=0.9,
                                                    logprobs=3)]
    params = [SamplingParams(seed=i if i % 3 else None, **kinds[i % len(kinds)])
              for i in range(24)]
    steps, seeds = [3 * i for i in range(24)], [1000 + i for i in range(24)]
    batch, _ = sample(logits, params, steps, seeds)
    order = list(range(24))[::-1]
    flipped, _ = sample(logits[order], [params[i] for i in order], [steps[i] for i in order],
                        [seeds[i] for i in order])
    assert flipped[::-1] == batch
    for i in range(24):
        alone, _ = sample(logits[i:i + 1], params[i:i + 1], steps[i:i + 1], seeds[i:i + 1])
        greedy_neighbour = torch.cat([logits[i:i + 1], logits[:3]])
        paired, _ = sample(greedy_neighbour, [params[i]] + [SamplingParams(temperature=0)] * 3,
                           [steps[i]] + [0] * 3, [seeds[i]] + [0] * 3)
        assert alone == [batch[i]] and paired[0] == batch[i], i


def test_draws_follow_the_distribution():
    assert close(draws(dict(temperature=1.0)), PROBS)


def test_temperature_sharpens_and_flattens():
    for t in (0.5, 2.0):
        w = [p ** (1 / t) for p in PROBS]
        assert close(draws(dict(temperature=t)), [x / sum(w) for x in w])


def test_top_k_and_top_p_keep_only_the_most_likely_tokens_in_proportion():
    assert close(draws(dict(temperature=1.0, top_k=2)), [0.625, 0.375, 0, 0])
    # top_p keeps tokens until the mass before them reaches it
    assert close(draws(dict(temperature=1.0, top_p=0.7)), [0.625, 0.375, 0, 0])
    assert close(draws(dict(temperature=1.0, top_p=0.85)), [0.5 / 0.95, 0.3 / 0.95,
                                                           0.15 / 0.95, 0])
    assert close(draws(dict(temperature=1.0, top_k=3, top_p=0.7)), [0.625, 0.375, 0, 0])


def test_a_seed_and_step_repeat_a_draw_and_each_step_draws_afresh():
    flat = torch.zeros(1, 64)
    sp = [SamplingParams(temperature=1.0, seed=5)]
    by_step = [sample(flat, sp, [step], [0])[0][0] for step in range(64)]
    assert by_step == [sample(flat, sp, [step], [0])[0][0] for step in range(64)]
    assert len(set(by_step)) > 30                      # 64 draws over 64 tokens
    assert row_uniform(5, 1) != row_uniform(6, 1) != row_uniform(5, 2)
    assert all(0 <= row_uniform(s, k) < 1 for s in (0, 1, 2 ** 63) for k in (0, 10 ** 9))


def test_a_tiny_temperature_and_top_k_of_one_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, 300)
    want = logits.argmax(-1).tolist()
    for kw in (dict(temperature=1e-4), dict(temperature=1.5, top_k=1)):
        got, _ = sample(logits, [SamplingParams(seed=i, **kw) for i in range(16)],
                        list(range(16)), [0] * 16)
        assert got == want


def test_min_tokens_masks_stop_ids_for_greedy_and_sampled_rows():
    logits = torch.zeros(2, 10)
    logits[:, 7] = 50.0                                # EOS all but certain
    logits[:, 3] = 49.0
    params = [SamplingParams(temperature=0, min_tokens=2),
              SamplingParams(temperature=1.0, seed=1, min_tokens=2, stop_token_ids=(3,))]
    early, _ = sample(logits, params, [0, 0], [0, 0], frozenset({7}))
    assert early[0] == 3 and early[1] not in (3, 7)
    late, _ = sample(logits, params, [2, 2], [0, 0], frozenset({7}))
    assert late[0] == 7


def test_logprobs_are_of_the_model_s_own_distribution():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0.5, top_k=5, seed=1, logprobs=3),
              SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=0)]
    tokens, lps = sample(logits, params, [0, 0, 0], [0, 0, 0])
    ref = torch.log_softmax(logits, dim=-1)
    assert lps[1] is None and lps[2].top == () and lps[2].token == tokens[2]
    assert math.isclose(lps[0].logprob, float(ref[0, tokens[0]]), rel_tol=1e-6)
    top_v, top_i = ref[0].topk(3)
    assert [t for t, _ in lps[0].top] == top_i.tolist()
    assert all(math.isclose(v, float(w), rel_tol=1e-6) for (_, v), w in zip(lps[0].top, top_v))


def test_a_vocabulary_of_many_blocks_draws_in_proportion_and_never_past_its_end():
    # the inverse CDF finds a block, then the token in it: mass on block edges,
    # on the short last block's last token, and nothing anywhere else
    vocab = 3 * BLOCK + 17
    want = {0: 0.1, BLOCK - 1: 0.2, BLOCK: 0.3, 2 * BLOCK + 5: 0.15, vocab - 1: 0.25}
    probs = [want.get(t, 0.0) for t in range(vocab)]
    freqs = draws(dict(temperature=1.0), probs)
    assert all(f == 0 for t, f in enumerate(freqs) if t not in want)
    assert close([freqs[t] for t in want], list(want.values()))


def _nucleus(row: torch.Tensor, top_p: float) -> set:
    """The tokens top-p keeps, by a full sort: the most likely first while
    the mass before them is under top_p (ties at the cut kept)."""
    p = torch.softmax(row.double(), dim=-1)
    desc = p.sort(descending=True).values
    kept = int(((desc.cumsum(0) - desc) < top_p).sum())
    return set(torch.nonzero(p >= desc[kept - 1]).view(-1).tolist())


def test_top_p_finds_its_cut_however_wide_the_nucleus():
    # rows whose nucleus is within the first candidates, within the second,
    # and past both (sorted whole): each draw lies in its row's nucleus, a row
    # draws the same alone and in the batch, and the draws are the previous
    # sampler's (a full sort of every row) but where rounding differs
    from pdserve.benchmarks.kernels.sampling import sample_before

    vocab, top_p, per_row = 6000, 0.9, 100
    g = torch.Generator().manual_seed(3)
    rows = []
    for slope in (0.05, 0.002, 0.0001):          # geometric weights, shuffled over the vocab
        rows.append((-slope * torch.arange(vocab, dtype=torch.float32))[
            torch.randperm(vocab, generator=g)])
    nuclei = [_nucleus(r, top_p) for r in rows]
    first, second = TOP_P_CANDIDATES
    assert [len(n) < first for n in nuclei] == [True, False, False]
    assert [len(n) < second for n in nuclei] == [True, True, False]
    logits = torch.stack(rows).repeat_interleave(per_row, dim=0)
    n = len(logits)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(n)]
    tokens, _ = sample(logits, params, [7] * n, [0] * n)
    for i, tok in enumerate(tokens):
        assert tok in nuclei[i // per_row], (i, tok)
    for i in (0, per_row + 1, 2 * per_row + 2):
        assert sample(logits[i:i + 1], params[i:i + 1], [7], [0])[0] == [tokens[i]]
    before = sample_before(logits, params, [7] * n, [0] * n)
    assert sum(a == b for a, b in zip(tokens, before)) >= 0.98 * n
    assert len({t for t in tokens[2 * per_row:]}) > 50           # a wide nucleus stays wide
