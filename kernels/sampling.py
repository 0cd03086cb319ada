"""Sampling parameters and turning logits into tokens.

Randomness is keyed by (seed, token index), never by the order requests
happen to be batched, so a seeded request gives the same tokens whatever
the schedule, retractions included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16        # None: until the context limit
    temperature: float = 1.0           # 0: greedy
    top_k: int = 0                     # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple = field(default_factory=tuple)          # stop strings
    stop_token_ids: tuple = field(default_factory=tuple)
    ignore_eos: bool = False
    strict: bool = False               # reserve the whole generation at admission
    min_tokens: int = 0                # EOS and stop ids are masked, stop strings unseen, until
    logprobs: int | None = None        # None: no logprobs; k: the chosen token's and the top k

    def __post_init__(self):
        def bad(name, value, want):
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {want}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or
                                            not isinstance(self.max_tokens, int) or
                                            self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "give an integer >= 1, or None")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            bad("temperature", self.temperature, "give a finite number >= 0 (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "give an integer >= 0 (0 turns it off)")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) \
                or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "give a number in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", self.seed, "give an integer >= 0, or None")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "give an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"give at most max_tokens={self.max_tokens}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or
                                          not isinstance(self.logprobs, int) or
                                          not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"give an integer in [0, {MAX_LOGPROBS}], or None")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "give non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


_MASK = 0x7FFFFFFFFFFFFFFF
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Logprob:
    """A sampled token's log-probability under the model's own distribution
    (before temperature, top-k and top-p), and the `top` most likely tokens
    as (token, logprob), most likely first."""
    token: int
    logprob: float
    top: tuple = ()


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           fallback_seeds: list[int], stop_ids: frozenset = frozenset()):
    """One token per row, and a Logprob for rows that asked (else None).
    `steps[i]` is how many tokens row i's request has generated so far;
    `fallback_seeds[i]` seeds an unseeded request; `stop_ids` (EOS) are masked,
    with each row's stop_token_ids, while the row is short of min_tokens."""
    raw = logits
    masked = [i for i, sp in enumerate(params) if steps[i] < sp.min_tokens]
    if masked:
        logits = logits.clone()
        for i in masked:
            sp = params[i]
            ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(stop_ids))
            ids = [t for t in ids if 0 <= t < logits.shape[-1]]
            if ids:
                logits[i, ids] = float("-inf")
    out = logits.argmax(dim=-1).tolist()
    for i, sp in enumerate(params):
        if sp.greedy:
            continue
        row = logits[i] / sp.temperature
        if sp.top_k:
            kth = torch.topk(row, min(sp.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if sp.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < sp.top_p
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        seed = sp.seed if sp.seed is not None else fallback_seeds[i]
        g = torch.Generator(device=logits.device).manual_seed(
            hash((seed, steps[i])) & _MASK)
        out[i] = int(torch.multinomial(probs, 1, generator=g))
    return out, _logprobs(raw, params, out)


def _logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list:
    rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    if not rows:
        return [None] * len(params)
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    k = max(params[i].logprobs for i in rows)
    top_v, top_i = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device))
    chosen, top_v, top_i = chosen.view(-1).tolist(), top_v.tolist(), top_i.tolist()
    out = [None] * len(params)
    for j, i in enumerate(rows):
        n = params[i].logprobs
        out[i] = Logprob(tokens[i], chosen[j], tuple(zip(top_i[j][:n], top_v[j][:n])))
    return out
