"""What an engine round computed, and how long it took: the one part of
the cost model the live engine records (`EngineServer.take_rounds`), so
`pdserve calibrate --served` and `bench sim-accuracy` can hold a profile
(sim/cost/profile.py) against real rounds."""

from __future__ import annotations

from dataclasses import dataclass


def computes(prefills, num_decodes: int) -> bool:
    """Whether a round with these prefill chunks and decodes runs a forward."""
    return num_decodes > 0 or any(n for _, n in prefills)


def round_kind(has_prefill: bool, num_decodes: int) -> str:
    if has_prefill:
        return "mixed" if num_decodes else "prefill"
    return "decode"


@dataclass(frozen=True)
class Round:
    """One timed engine round and what it computed."""
    prefills: tuple            # (begin, tokens) per chunk, replay rows included
    decode_contexts: int       # sum of the decodes' context lengths
    num_decodes: int
    window_contexts: int       # sum of min(context, window) (0 without sliding layers)
    seconds: float
    start: float | None = None  # a serving engine's wall clock (time.time()) as it began

    @property
    def kind(self) -> str:
        return round_kind(bool(self.prefills), self.num_decodes)

    @property
    def computed(self) -> bool:
        """Whether it ran a forward: what a profile prices. The simulator
        charges a round without one nothing (P's round that only ships a
        finished prompt takes 0.2 ms; priced as a decode it read +62,400%)."""
        return computes(self.prefills, self.num_decodes)


def round_of(plan, seconds: float, window: int, start: float | None = None) -> Round:
    """A plan's features as the simulated executor hands them to the cost
    model (sim/executor.py), and its time. `window`: the model's
    sliding window (0: none). `start`: when it began (a serving engine's
    wall clock, comparable across the engines of a host)."""
    ctx = wctx = 0
    for req in plan.decodes:
        n = req.num_tokens
        ctx += n
        wctx += min(n, window) if window else 0
    return Round(tuple((op.begin - op.replay, op.tokens + op.replay) for op in plan.prefills),
                 ctx, len(plan.decodes), wctx, seconds, start)


def neighbours(per_engine: list[list]) -> list[int]:
    """For each round (engine by engine, in order), how many other engines
    were computing a round when it began, by the rounds' wall-clock starts."""
    spans = [[(r.start, r.start + r.seconds) for r in rs] for rs in per_engine]
    out = []
    for i, rs in enumerate(per_engine):
        for r in rs:
            out.append(sum(1 for j, sp in enumerate(spans) if j != i and
                           any(a <= r.start < b for a, b in sp)))
    return out
