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


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           fallback_seeds: list[int]) -> list[int]:
    """One token per row. `steps[i]` is how many tokens row i's request has
    generated so far; `fallback_seeds[i]` seeds an unseeded request."""
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
    return out
