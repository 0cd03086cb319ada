"""The draft-model proposer: a small model sharing the target's vocabulary
guesses each request's next k tokens, one batched forward per candidate.

A round of drafting, over every asking request at once:

1. catch up: each request feeds the tokens of its context its draft K/V
   does not hold yet (draft_pages.py keeps which do: after a verify,
   usually the new token and at most one accepted candidate; after a miss,
   the whole context), and the last row's logits give candidate 1;
2. k - 1 one-row forwards, each feeding the candidate just chosen, give the
   others (a request asking fewer drops out of the batch).

A greedy request takes the draft's argmax (a point mass: the verify
accepts it with the target's own probability, or keeps it while it equals
the target's argmax). A sampling request draws from the draft's q, its
logits under the request's own temperature, min-p, top-k and top-p, at
`row_uniform(seed ^ DRAFT_SALT, step)` for the candidate of generation
step `step`, so its candidates depend on its context and seed, never on
its batch; q rides with the candidates (`Draft.probs`) for the min(1, p/q)
test (kernels/rejection.py).

The candidates' own K/V are written as they are fed; the next ask keeps
those the verify accepted (they are a prefix of the new context) and
overwrites the rest.
"""

from __future__ import annotations

import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.draft_pages import DraftPages
from pdserve.kernels.proposers import Draft, DraftAsk, Proposer
from pdserve.kernels.sampling import draw, row_uniform, weights

DRAFT_SALT = 0x2545F4914F6CDD1D


def draft_uniform(seed: int, step: int) -> float:
    """The draft's draw for the candidate of generation step `step`."""
    return row_uniform(seed ^ DRAFT_SALT, step)


class DraftModelProposer(Proposer):
    name = "draft"

    def __init__(self, model, pages: int, page_size: int):
        """`model`: the draft (a kernels model; its cache groups must keep
        K/V pages, not state); `pages` of `page_size` tokens in each of its
        cache groups, shared by every request it drafts for."""
        groups = model.cache_groups()
        if any(g.state for g in groups):
            raise ValueError("a draft model with state layers cannot be rolled back past a "
                             "rejected candidate; use an attention-only draft model")
        self.model = model
        self.max_position = model.cfg.max_position
        self.windows = [g.window if g.sliding else None for g in groups]
        self.caches = model.new_caches([pages] * len(groups), page_size)
        self.pages = DraftPages(pages, page_size)
        self.forwards = 0           # draft forwards run (k a round that drafts)

    def forget(self, req_id: str) -> None:
        self.pages.drop(req_id)

    @torch.inference_mode()
    def propose(self, asks: list[DraftAsk], hidden=None) -> list[Draft]:
        out = [Draft([]) for _ in asks]
        busy = {a.req_id for a in asks}
        # (ask index, the context position its pages hold K/V up to)
        live: list[tuple[int, int]] = []
        ks: dict[int, int] = {}
        for i, a in enumerate(asks):
            # candidate j is fed at position len(context) + j - 1: all inside
            # the draft's positions (a draft may know fewer than the target)
            ks[i] = min(a.k, self.max_position - len(a.context) + 1)
            if ks[i] < 1 or not a.context:
                continue
            valid = self.pages.reserve(a.req_id, list(a.context), len(a.context) + ks[i] - 1,
                                       busy)
            if valid is not None:
                live.append((i, valid))
        if not live:
            return out
        # longest catch-up first: the one-row ones batch as decodes behind it
        live.sort(key=lambda iv: -(len(asks[iv[0]].context) - iv[1]))
        feeds = [(i, list(asks[i].context[v:]), v) for i, v in live]
        cands: dict[int, list] = {i: [] for i, _ in live}
        probs: dict[int, list] = {i: [] for i, _ in live}
        for j in range(max(ks[i] for i, _ in live)):
            if j:
                feeds = [(i, [cands[i][-1]], len(asks[i].context) + j - 1)
                         for i, _ in live if ks[i] > j]
            logits = self._forward([(asks[i].req_id, toks, at) for i, toks, at in feeds])
            self._choose(asks, [i for i, _, _ in feeds], logits, j, cands, probs)
        for i, _ in live:
            a = asks[i]
            self.pages.wrote(a.req_id, list(a.context) + cands[i][:-1])
            q = torch.stack(probs[i]) if probs[i] and probs[i][0] is not None else None
            out[i] = Draft(cands[i], q)
        return out

    def _forward(self, feeds: list) -> torch.Tensor:
        """One forward of the draft: each (request, tokens, first position)
        writes its tokens' K/V and gives its last row's logits."""
        ps = self.pages.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seqs: list[SeqMeta] = []
        last: list[int] = []
        for rid, toks, at in feeds:
            table = self.pages.table(rid)
            seqs.append(SeqMeta(len(ids), len(toks), at + len(toks), table))
            ids.extend(toks)
            pos.extend(range(at, at + len(toks)))
            slots.extend(table[p // ps] * ps + p % ps for p in range(at, at + len(toks)))
            last.append(len(ids) - 1)
        ones = 0
        while ones < len(seqs) and seqs[len(seqs) - 1 - ones].q_len == 1:
            ones += 1
        dev = self.model.device
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        metas = [BatchMeta(seqs, slot_t, pos_t, num_decodes=ones, window=w)
                 for w in self.windows]
        self.forwards += 1
        return self.model.forward(torch.tensor(ids, dtype=torch.long, device=dev), metas,
                                  self.caches, torch.tensor(last, dtype=torch.long, device=dev))

    @staticmethod
    def _choose(asks, which: list[int], logits: torch.Tensor, j: int, cands, probs) -> None:
        """Candidate j of each request in `which` (logits' rows in order)."""
        greedy = [n for n, i in enumerate(which) if _greedy(asks[i])]
        if greedy:
            best = logits[greedy].argmax(-1).tolist()
            for n, t in zip(greedy, best):
                cands[which[n]].append(t)
                probs[which[n]].append(None)
        sampled = [n for n, i in enumerate(which) if not _greedy(asks[i])]
        if not sampled:
            return
        params = [asks[which[n]].params for n in sampled]
        w = weights(logits[sampled], params).float()
        q = w / w.sum(-1, keepdim=True)
        toks = draw(q, [draft_uniform(asks[which[n]].seed, asks[which[n]].step + j)
                        for n in sampled]).tolist()
        for r, (n, t) in enumerate(zip(sampled, toks)):
            cands[which[n]].append(t)
            probs[which[n]].append(q[r].cpu())


def _greedy(a: DraftAsk) -> bool:
    return a.params is None or a.params.greedy
