"""Speculative proposers: what guesses a request's next tokens cheaply, for
one target forward to verify (kernels/spec/rejection.py).

A proposer answers a batch of `DraftAsk`s (a request's tokens so far, and
how many candidates it may carry) with one `Draft` each: the candidate
tokens, and the drafter's probabilities for them when it sampled them (a
draft model); None where the proposal is a point mass (n-gram lookup, a
greedy drafter), which the verify accepts with the target's own
probability. A proposer may answer fewer candidates than asked, or none.

`NgramProposer` (prompt lookup, vLLM's `prompt_lookup_min` /
`prompt_lookup_max`) needs no weights: it finds the request's last n tokens
earlier in its own prompt and output, n from the longest down, and proposes
what followed them there. `DraftModelProposer` (kernels/spec/draft_model.py)
runs a small model sharing the target's vocabulary. Heads that read the target's hidden states
(EAGLE, MTP) fit the same interface: `needs_hidden` asks the executor to
pass the last forward's hidden states beside the asks.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pdserve.text.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftAsk:
    req_id: str
    context: Sequence[int]      # prompt and output so far; the last one was just sampled
    # the most candidates this verify may carry; 0: none, only keep up (a
    # proposer that keeps K/V computes `context[start:]`, the round's rows,
    # whose last token was not just sampled then)
    k: int
    # how the request samples (a drafter that samples draws as the target
    # would); None: greedy. `seed` and `step` (the generation index of the
    # first candidate) key a sampling drafter's draws, as `sample`'s are keyed
    params: SamplingParams | None = None
    seed: int = 0
    step: int = 0
    # for a proposer that keeps K/V in the planner's pages (`keeps_kv`): the
    # round's first position (the pages hold K/V below it) and the
    # request's block table in each of the proposer's cache groups
    start: int = 0
    tables: tuple = ()


@dataclass(frozen=True)
class Draft:
    tokens: list
    # [len(tokens), vocab] the drafter's probabilities (float32 tensor), or
    # None: a point mass on each token (lookup, a greedy drafter)
    probs: object = None


class Proposer(abc.ABC):
    name = ""
    needs_hidden = False        # EAGLE / MTP heads: the target's hidden states ride along
    # K/V in the planner's pages (a draft model): asked after every round,
    # for every request the round ran, so its K/V keep up with the target's
    keeps_kv = False
    # keeps_kv: per cache group of the proposer's, the target's page group
    # whose block tables it reads (DraftAsk.tables)
    target_groups: tuple = ()

    @abc.abstractmethod
    def propose(self, asks: list[DraftAsk], hidden=None) -> list[Draft]:
        """One Draft per ask, in order, at most `ask.k` tokens each."""

    def forget(self, req_id: str) -> None:
        """`req_id` ended: drop anything kept for it."""


class NgramProposer(Proposer):
    """Prompt lookup: the longest suffix of n tokens (prompt_lookup_max
    down to prompt_lookup_min) that occurred before, the latest occurrence,
    and the k tokens that followed it."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} and prompt_lookup_max="
                             f"{prompt_lookup_max}: give 1 <= min <= max")
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max

    def propose(self, asks: list[DraftAsk], hidden=None) -> list[Draft]:
        return [Draft(lookup(a.context, self.lo, self.hi, a.k)) for a in asks]


def lookup(context: Sequence[int], lo: int, hi: int, k: int) -> list[int]:
    """What followed the latest earlier occurrence of the context's last n
    tokens, for the largest n in [lo, hi] that has one; [] if none does."""
    size = len(context)
    if size < lo + 1 or k < 1:
        return []
    ctx = np.asarray(context, dtype=np.int64)
    for n in range(min(hi, size - 1), lo - 1, -1):
        suffix = ctx[size - n:]
        # windows starting before the suffix itself: positions 0 .. size - n - 1
        windows = np.lib.stride_tricks.sliding_window_view(ctx[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ctx[start:start + k].tolist()
    return []
