"""What one round asks the executor to do, and what it reports back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillOp:
    req: object          # the Request
    begin: int           # first token this chunk computes
    tokens: int          # tokens it computes (re-fed replay rows not included)
    completes: bool      # reaches the end of the prefill: samples a token
    replay: int = 0      # rows re-fed ahead of `begin` (bounded replay, §1.3)


@dataclass(slots=True)
class Plan:
    round: int
    # Requests decoding one token each, in batch order. Every one of them has
    # capacity for the token it feeds (num_tokens <= capacity).
    decodes: list = field(default_factory=list)
    # Prefill chunks, in batch order; at most the last one is incomplete (§1.1).
    prefills: list = field(default_factory=list)
    # Pages granted this round; an executor that needs clean pages zeroes them.
    fresh_pages: list = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills)

    @property
    def prefill_tokens(self) -> int:
        return sum(op.tokens + op.replay for op in self.prefills)


@dataclass(slots=True)
class StepResult:
    # One sampled token per plan.decodes entry, in the same order.
    decode_tokens: list = field(default_factory=list)
    # One entry per plan.prefills entry: the sampled token of a completing
    # chunk, None for an intermediate chunk (its arrival is the point).
    prefill_tokens: list = field(default_factory=list)
    # Requests whose sampled token met a stop condition (EOS, stop string).
    stopped: set = field(default_factory=set)
