"""The draft-model proposer: a small model sharing the target's vocabulary
guesses each request's next k tokens, one batched forward per candidate.

Its K/V live in the planner's pages (kernels/kv_cache.py): each draft
cache group's layers sit in the pages of the target's group of the same
kind, under the request's one block table, so they are admitted, counted,
cached, stored, read from disk, shipped P -> D and freed with the target's.
Every page the target computes, the drafter computes too: after each round
it feeds, for every request the round ran, the tokens whose target K/V the
round wrote and kept (a prefill chunk; a decode's input; a verify's input
and accepted candidates). So wherever a block table holds the target's
K/V it holds the draft's, a prefix hit serves both, and a request that
arrives on D from P drafts on from the pages that arrived.

A round's drafting, over every request at once (`DraftAsk.start` is the
round's first position; `tables` the request's block tables):

1. one forward feeds every request's rows from `start`; a request asking
   for candidates also feeds the token just sampled, and that row's
   logits give candidate 1;
2. k - 1 one-row forwards, each feeding the candidate just chosen, give the
   others (a request asking fewer drops out of the batch).

A position with no page in the block table yet (the token just sampled
past a verify's reserve, and the candidates) is written to a scratch page
no table holds; those K/V are guesses, never read after this round: the
next round feeds what the verify kept into the pages the planner admitted
for it by then.

A greedy request takes the draft's argmax (a point mass: the verify
accepts it with the target's own probability, or keeps it while it equals
the target's argmax). A sampling request draws from the draft's q, its
logits under the request's own temperature, min-p, top-k and top-p, at
`row_uniform(seed ^ DRAFT_SALT, step)` for the candidate of generation
step `step`, so its candidates depend on its context and seed, never on
its batch; q rides with the candidates (`Draft.probs`) for the min(1, p/q)
test (kernels/spec/rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.spec.proposers import Draft, DraftAsk, Proposer
from pdserve.kernels.sampling import draw, row_uniform, weights

DRAFT_SALT = 0x2545F4914F6CDD1D


def draft_uniform(seed: int, step: int) -> float:
    """The draft's draw for the candidate of generation step `step`."""
    return row_uniform(seed ^ DRAFT_SALT, step)


@dataclass
class _Feed:
    """One request's part of a draft forward."""
    ask: int                # index into the round's asks
    tokens: list            # fed this forward
    at: int                 # position of the first
    tables: list            # per draft group: its block table, scratch pages appended
    logits: bool            # whether its last row's logits are wanted


class DraftModelProposer(Proposer):
    name = "draft"
    keeps_kv = True

    def __init__(self, model, caches: list, scratch: list[list[int]], page_size: int,
                 target_groups: tuple | None = None):
        """`model`: the draft (a kernels model; its cache groups must keep
        K/V pages, not state). `caches`: per draft cache group, its layers
        (the companion layers of the target's pages, `KVCache.draft_layers`).
        `scratch`: per group, page ids no block table holds, for positions
        past a request's table (a request's candidates need at most
        ceil(k / page_size) of them; when a round's asks need more, the
        last asking ones feed their rows but get no candidates).
        `target_groups`: per draft group, the target's page group whose
        block tables it reads (default: the same index)."""
        groups = model.cache_groups()
        if any(g.state for g in groups):
            raise ValueError("a draft model with state layers cannot be rolled back past a "
                             "rejected candidate; use an attention-only draft model")
        if len(caches) != len(groups) or len(scratch) != len(groups):
            raise ValueError(f"{len(caches)} caches and {len(scratch)} scratch lists for the "
                             f"draft's {len(groups)} cache groups")
        self.model = model
        self.target_groups = target_groups if target_groups is not None \
            else tuple(range(len(groups)))
        self.page_size = page_size
        self.max_position = model.cfg.max_position
        self.windows = [g.window if g.sliding else None for g in groups]
        self.caches = caches
        self.scratch = scratch
        self.forwards = 0           # draft forwards run
        # rows fed at positions whose target K/V the round kept (a request's
        # new token, fed for its candidates, comes again with the next round)
        self.kept_rows = 0
        self.starved = 0            # asks that got no candidates for want of scratch pages

    @torch.inference_mode()
    def propose(self, asks: list[DraftAsk], hidden=None) -> list[Draft]:
        out = [Draft([]) for _ in asks]
        ps = self.page_size
        free = [list(s) for s in self.scratch]
        feeds: list[_Feed] = []
        ks: dict[int, int] = {}
        for i, a in enumerate(asks):
            if len(a.tables) != len(self.caches):
                raise ValueError(f"{a.req_id}: {len(a.tables)} block tables for the draft's "
                                 f"{len(self.caches)} cache groups")
            # candidate j is fed at position len(context) + j - 1: all inside
            # the draft's positions (a draft may know fewer than the target)
            k = min(a.k, self.max_position - len(a.context) + 1)
            end = len(a.context)
            if k >= 1 and end > a.start:
                need = -(-(end + k - 1) // ps)
                extra = [max(need - len(t), 0) for t in a.tables]
                if all(x <= len(f) for x, f in zip(extra, free)):
                    ks[i] = k
                    tables = [list(t) + [f.pop() for _ in range(x)]
                              for t, x, f in zip(a.tables, extra, free)]
                else:
                    self.starved += 1
                    k = 0
            else:
                k = 0
            if k < 1:
                end -= a.k >= 1        # the token just sampled has no page yet: not fed
                tables = [list(t) for t in a.tables]
            if end > a.start:
                feeds.append(_Feed(i, list(a.context[a.start:end]), a.start, tables, k >= 1))
        if not feeds:
            return out
        # longest feed first: the one-row ones batch as decodes behind it
        feeds.sort(key=lambda f: -len(f.tokens))
        self.kept_rows += sum(len(f.tokens) - f.logits for f in feeds)
        cands: dict[int, list] = {i: [] for i in ks}
        probs: dict[int, list] = {i: [] for i in ks}
        table_of = {f.ask: f.tables for f in feeds}
        for j in range(max(ks.values(), default=1)):
            if j:
                feeds = [_Feed(i, [cands[i][-1]], len(asks[i].context) + j - 1, table_of[i], True)
                         for i in ks if ks[i] > j]
            logits = self._forward(feeds)
            want = [f.ask for f in feeds if f.logits]
            if want:
                self._choose(asks, want, logits, j, cands, probs)
        for i in ks:
            q = torch.stack(probs[i]) if probs[i] and probs[i][0] is not None else None
            out[i] = Draft(cands[i], q)
        if self.model.device.type == "cuda":
            # a keep-up-only round reads nothing back: its writes must land
            # before a transfer (not ordered on the stream) reads or a peer
            # writes these pages, or the pages go back to the pool
            torch.cuda.current_stream(self.model.device).synchronize()
        return out

    def _forward(self, feeds: list[_Feed]) -> torch.Tensor:
        """One forward of the draft: each feed writes its tokens' K/V; the
        logits of the last row of each feed that wants them."""
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[list[int]] = [[] for _ in self.caches]
        seqs: list[list[SeqMeta]] = [[] for _ in self.caches]
        last: list[int] = []
        for f in feeds:
            n = len(f.tokens)
            for g, w in enumerate(self.windows):
                table = f.tables[g]
                kv_start = max(f.at - w + 1, 0) if w is not None else 0
                seqs[g].append(SeqMeta(len(ids), n, f.at + n, table, kv_start))
                slots[g].extend(table[p // ps] * ps + p % ps for p in range(f.at, f.at + n))
            ids.extend(f.tokens)
            pos.extend(range(f.at, f.at + n))
            if f.logits:
                last.append(len(ids) - 1)
        ones = 0
        while ones < len(feeds) and len(feeds[len(feeds) - 1 - ones].tokens) == 1:
            ones += 1
        dev = self.model.device
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        metas = [BatchMeta(seqs[g], torch.tensor(slots[g], dtype=torch.long, device=dev), pos_t,
                           num_decodes=ones, window=w)
                 for g, w in enumerate(self.windows)]
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
