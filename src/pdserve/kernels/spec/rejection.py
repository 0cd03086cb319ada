"""Verifying a speculative draft: the target's k + 1 rows of logits for a
request, scored in one forward, against the candidates it fed.

Lossless in distribution (Leviathan et al., Chen et al.): a greedy request
takes the target's argmax at each row and keeps the candidates while they
equal it, so its tokens are those plain greedy decoding gives. A sampling
request accepts candidate j with probability min(1, p(x) / q(x)) (p: the
target's weights at row j as `sample` draws from them, after temperature,
min-p, top-k and top-p; q: the drafter's; a point-mass proposal, q(x) = 1,
is accepted with p(x)); the first rejected row draws from max(p - q, 0)
renormalized (a point mass: p with x taken out), and a request whose every
candidate was accepted draws its bonus token from p at the last row.

Every draw is keyed by (seed, position) as in `sample`: the draw of the
token at generation step s is `row_uniform(seed, s)`, and the acceptance
test of the candidate for step s is `row_uniform(seed ^ ACCEPT_SALT, s)`,
so a seeded request's tokens depend on its drafts, never on its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.sampling import draw, row_uniform, weights
from pdserve.text.sampling_params import SamplingParams

ACCEPT_SALT = 0x5BD1E9955BD1E995


@dataclass(frozen=True)
class VerifyRow:
    """One request's verify: the candidates it fed, and how it samples."""
    drafts: list
    params: SamplingParams
    seed: int
    step: int                   # generation index of the first token this verify gives
    probs: torch.Tensor | None = None   # [len(drafts), vocab] the drafter's q; None: point mass


def accept_uniform(seed: int, step: int) -> float:
    """The acceptance test's draw for the candidate of generation step `step`."""
    return row_uniform(seed ^ ACCEPT_SALT, step)


def verify(logits: torch.Tensor, rows: list[VerifyRow]) -> list[list[int]]:
    """Per request, the tokens the verify gives: the accepted candidates and
    one more (the correction at the first rejection, else the bonus), a + 1
    tokens for a accepted. `logits`: every request's 1 + len(drafts) rows,
    concatenated in order."""
    starts, at = [], 0
    for r in rows:
        starts.append(at)
        at += 1 + len(r.drafts)
    if at != logits.shape[0]:
        raise ValueError(f"verify: {logits.shape[0]} rows of logits for {at} verify positions")
    out: list[list[int]] = [[] for _ in rows]
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        idx = [starts[i] + j for i in greedy for j in range(1 + len(rows[i].drafts))]
        best = logits[idx].argmax(dim=-1).tolist() if len(idx) < at else \
            logits.argmax(dim=-1).tolist()
        k = 0
        for i in greedy:
            r = rows[i]
            top = best[k:k + 1 + len(r.drafts)]
            k += len(top)
            a = 0
            while a < len(r.drafts) and r.drafts[a] == top[a]:
                a += 1
            out[i] = top[:a + 1]
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        _verify_sampled(logits, rows, starts, sampled, out)
    return out


def _verify_sampled(logits, rows: list[VerifyRow], starts, sampled: list[int], out) -> None:
    idx = [starts[i] + j for i in sampled for j in range(1 + len(rows[i].drafts))]
    params = [rows[i].params for i in sampled for _ in range(1 + len(rows[i].drafts))]
    w = weights(logits[idx], params).double()
    p = w / w.sum(-1, keepdim=True)
    # p(x) of each candidate, and q(x) where the drafter sampled it
    cand_rows: list[int] = []
    cand_tok: list[int] = []
    local: list[int] = []
    k = 0
    for i in sampled:
        r = rows[i]
        cand_rows += range(k, k + len(r.drafts))
        cand_tok += r.drafts
        local.append(k)
        k += 1 + len(r.drafts)
    ratio = p[cand_rows, cand_tok] if cand_rows else p.new_zeros(0)
    qs = [rows[i].probs for i in sampled if rows[i].probs is not None]
    if qs:
        qx = torch.cat([_q_of_drafts(rows[i]) for i in sampled]).to(p.device)
        ratio = torch.clamp(ratio / qx, max=1.0)
    ratios = ratio.tolist()
    final_rows, finals, draws = [], [], []
    c = 0
    for n, i in enumerate(sampled):
        r = rows[i]
        a = 0
        while a < len(r.drafts) and accept_uniform(r.seed, r.step + a) < ratios[c + a]:
            a += 1
        c += len(r.drafts)
        row = p[local[n] + a]
        if a < len(r.drafts):           # the residual at the first rejection
            if r.probs is None:
                row = row.clone()
                row[r.drafts[a]] = 0.0
            else:
                row = torch.clamp(row - r.probs[a].to(row), min=0.0)
            if not float(row.sum()) > 0:
                row = p[local[n] + a]   # p == q to the last bit: nothing to correct
        final_rows.append(row)
        finals.append((i, r.drafts[:a]))
        draws.append(row_uniform(r.seed, r.step + a))
    tokens = draw(torch.stack(final_rows), draws).tolist()
    for (i, kept), t in zip(finals, tokens):
        out[i] = list(kept) + [t]


def _q_of_drafts(r: VerifyRow) -> torch.Tensor:
    """q(x) of each candidate: the drafter's probability, 1 for a point mass."""
    if r.probs is None:
        return torch.ones(len(r.drafts), dtype=torch.float64)
    return r.probs.double()[range(len(r.drafts)), r.drafts]
