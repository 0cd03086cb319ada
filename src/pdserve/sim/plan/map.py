"""`pdserve plan` over several TPOT SLOs and prompt lengths: where, on the
same GPUs, does a P:D split beat fused engines?

Each cell (prompts cut at one length, one TPOT SLO, the TTFT SLO and the
attainment the same everywhere) runs two searches (search.make_plan):
the fused candidates alone and the P:D splits alone, so both goodputs
are found to the tolerance; in one search the loser would be dropped as
soon as it fell behind, its goodput only bounded. A cell's answer is the
better of the two and their ratio.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Callable

from pdserve.config import ServeConfig
from pdserve.scheduler.request import BlockPrompt, TokenPrompt
from pdserve.sim.plan.search import Bracket, Settings, make_plan
from pdserve.sim.trace import TraceRequest


class Winner(enum.Enum):
    SPLIT = "P/D"
    FUSED = "fused"
    TIE = "tie"             # within the searches' tolerance: neither is known to be ahead
    NEITHER = "neither"     # no rate passed for either


@dataclass(frozen=True)
class Cell:
    prompt_len: int | None      # prompts cut at this many tokens (None: as traced)
    tpot_s: float
    fused: Bracket              # the best fused candidate's search
    split: Bracket              # the best P:D split's
    tolerance: float = 0.1      # the searches': closer than this is a tie

    @property
    def winner(self) -> Winner:
        f, s = self.fused.goodput_factor, self.split.goodput_factor
        if not f and not s:
            return Winner.NEITHER
        tol = 1 + self.tolerance
        if s > f * tol:
            return Winner.SPLIT
        return Winner.FUSED if f > s * tol else Winner.TIE

    @property
    def ratio(self) -> float | None:
        """P:D's goodput over fused's (None where fused passes nowhere)."""
        f = self.fused.goodput_factor
        return self.split.goodput_factor / f if f else None


def cut_prompts(trace: list[TraceRequest], length: int) -> list[TraceRequest]:
    """Each request's prompt cut to at most `length` tokens (the blocks of
    a prompt named by hash ids that it still reaches kept, so the prefix
    sharing within those stays)."""
    out = []
    for t in trace:
        p = t.prompt
        if isinstance(p, BlockPrompt):
            n = min(len(p), length)
            cut: object = BlockPrompt(p.hash_ids[:-(-n // p.block_tokens)], n, p.block_tokens)
        else:
            cut = TokenPrompt(list(p.tokens[:length]))  # type: ignore[attr-defined]
        out.append(dataclasses.replace(t, prompt=cut))
    return out


def plan_map(base: ServeConfig, trace: list[TraceRequest], settings: Settings,
             prompt_lens: list[int | None], tpots: list[float],
             pool_for: Callable, progress: bool = True,
             say: Callable[[str], None] = print) -> list[Cell]:
    """Every (prompt length, TPOT SLO) cell, prompt lengths outermost.
    `pool_for(trace, slo)`: the probe pool for a cell's trace and SLO."""
    cells = []
    for length in prompt_lens:
        cut = trace if length is None else cut_prompts(trace, length)
        for tpot in tpots:
            s = dataclasses.replace(settings, slo=dataclasses.replace(settings.slo, tpot_s=tpot))
            pool = pool_for(cut, s.slo)
            fused, split = (make_plan(base, cut, s, pool, progress, disaggregated=d).ranked()[0]
                            for d in (False, True))
            cells.append(Cell(length, tpot, fused, split, settings.tolerance))
            say(f"  {cell_line(cells[-1], settings.gpus, cut)}")
    return cells


def cell_line(c: Cell, gpus: int, trace: list[TraceRequest]) -> str:
    from pdserve.sim.trace import native_rate

    rate = native_rate(trace)
    what = "as traced" if c.prompt_len is None else f"cut at {c.prompt_len:,}"
    f, s = c.fused.goodput_factor * rate, c.split.goodput_factor * rate
    ratio = "" if c.ratio is None else f", P/D {c.ratio:.2f}x fused"
    return (f"prompts {what}, TPOT <= {c.tpot_s * 1000:g} ms: {c.winner.value} (fused x{gpus} "
            f"{f:.2f} req/s, best split {c.split.candidate.shape} {s:.2f} req/s{ratio})")


def format_map(cells: list[Cell]) -> str:
    """A markdown table: a row per prompt length, a column per TPOT SLO;
    each cell the winner and P/D's goodput over fused's."""
    tpots = list(dict.fromkeys(c.tpot_s for c in cells))
    lens = list(dict.fromkeys(c.prompt_len for c in cells))
    at = {(c.prompt_len, c.tpot_s): c for c in cells}
    rows = ["| prompts | " + " | ".join(f"TPOT <= {t * 1000:g} ms" for t in tpots) + " |",
            "| --- |" + " --- |" * len(tpots)]
    for n in lens:
        cols = []
        for t in tpots:
            c = at[(n, t)]
            ratio = "" if c.ratio is None else f" ({c.ratio:.2f}x, {c.split.candidate.shape})"
            cols.append(f"{c.winner.value}{ratio}")
        rows.append(f"| {'as traced' if n is None else f'cut at {n:,}'} | " +
                    " | ".join(cols) + " |")
    return "\n".join(rows)


def map_json(cells: list[Cell], gpus: int, trace_path: str) -> dict:
    from pdserve.sim.plan.report import candidate_json

    return {"trace": trace_path, "gpus": gpus,
            "cells": [{"prompt_len": c.prompt_len, "tpot_s": c.tpot_s, "winner": c.winner.value,
                       "split_over_fused": c.ratio, "fused": candidate_json(c.fused, gpus),
                       "split": candidate_json(c.split, gpus)} for c in cells]}
