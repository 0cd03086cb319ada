"""`pdserve plan`: the best P:D split and chunk size for a trace and an SLO.

Candidates are every way to run N engines (N fused, or P prefill + D decode
with P + D = N) times each chunk budget (engine.max_scheduled_tokens). For
each, a bisection finds the highest arrival rate, the trace's own arrivals
sped up by a factor, at which at least `attainment` of the requests meet
both TTFT and TPOT: DistServe's goodput. Every probe is one simulation
(`sim/simulation.py`: the real planner on a cost model), open loop.

    starts (cost-model ceilings) -> a free slot: the live candidate with
    the highest ceiling, its next probe -> its bracket [lo passes, hi
    fails] narrows -> ... until every candidate converged or lost

As many probes run at once as there are CPUs (Ray tasks, or in-process one
at a time); a candidate's own probes run one after another. Once some
candidate passes at a rate, every other is probed there next: one that
fails at it cannot win and is dropped as dominated, without the slow
low-rate probes a full bisection would run. Results are taken in the order
the probes started, so the plan does not depend on which finished first. A
probe stops as soon as its misses make the target unreachable (`SloWatch`),
so rates past capacity cost a fraction of a run.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.config import ClusterShape, ServeConfig
from pdserve.sim.plan.probe import Probe
from pdserve.sim.report import Slo
from pdserve.sim.trace import TraceRequest, native_rate
from pdserve.sim.cost.profile import simulated_cost
from pdserve.scheduler.config import ConfigError

DEFAULT_CHUNKS = (2048, 8192)
DEFAULT_TOLERANCE = 0.1   # stop when the failing rate is within 10% of the passing one
# Until a bracket closes, its open side moves by these factors a probe: down
# in small steps (the start is a ceiling, and a failing probe stops early,
# while a pass far below the boundary costs a whole slow run), up in big
# ones (every pass is a whole run). A search gives up RANGE x from its start.
DOWN = math.sqrt(2)
UP = 2.0
RANGE = 64.0


@dataclass(frozen=True)
class Candidate:
    prefill: int
    decode: int
    fused: int
    chunk: int            # engine.max_scheduled_tokens

    @property
    def engines(self) -> int:
        return self.prefill + self.decode + self.fused

    @property
    def shape(self) -> str:
        return f"fused x{self.fused}" if self.fused else f"{self.prefill}P+{self.decode}D"

    @property
    def name(self) -> str:
        return f"{self.shape} chunk {self.chunk}"

    def config(self, base: ServeConfig) -> ServeConfig:
        return dataclasses.replace(
            base, cluster=ClusterShape(self.prefill, self.decode, self.fused),
            engine=dataclasses.replace(base.engine, max_scheduled_tokens=self.chunk),
            engine_overrides=base.engine_overrides | {"max_scheduled_tokens"})


def candidates(gpus: int, chunks) -> list[Candidate]:
    """N fused engines, then every P:D split of N from 1P upward, each with
    every chunk budget in the order given."""
    shapes = [(0, 0, gpus)] + [(p, gpus - p, 0) for p in range(1, gpus)]
    return [Candidate(p, d, f, c) for p, d, f in shapes for c in chunks]


@dataclass(frozen=True)
class Settings:
    slo: Slo
    attainment: float = 0.9
    gpus: int = 8
    chunks: tuple = DEFAULT_CHUNKS
    tolerance: float = DEFAULT_TOLERANCE
    width: int = 2            # probes in flight: the CPUs that run them


def check_settings(s: Settings, base: ServeConfig) -> list[str]:
    """Raise ConfigError for what cannot be planned; return notes for what
    narrows the search."""
    for flag, v in (("--ttft", s.slo.ttft_s), ("--tpot", s.slo.tpot_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            what = "time to first token" if flag == "--ttft" else "time per output token"
            raise ConfigError(f"{flag} must be a positive number of seconds, got {v!r}; give "
                              f"the {what} target, e.g. {flag} "
                              f"{'2' if flag == '--ttft' else '0.05'}")
    if not 0 < s.attainment <= 1:
        raise ConfigError(f"--attainment must be in (0, 1], got {s.attainment!r}: the fraction "
                          "of requests that must meet both SLOs, e.g. 0.9")
    if s.gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {s.gpus}: the engines (one GPU "
                          "each) the plan may use")
    if not 0 < s.tolerance < 1:
        raise ConfigError(f"--tolerance must be between 0 and 1, got {s.tolerance!r}, e.g. 0.1 "
                          "to stop when the bracket is within 10%")
    if not s.chunks:
        raise ConfigError("--chunks needs at least one chunk budget, e.g. --chunks 2048 8192")
    for c in s.chunks:
        if c < base.engine.page_size:
            raise ConfigError(f"--chunks {c} is below engine.page_size={base.engine.page_size}: "
                              "a chunk budget must hold at least one page; raise it")
    notes = []
    if s.gpus == 1:
        notes.append("--gpus 1 allows only one fused engine (a P:D split needs at least 2 "
                     "GPUs); searching the chunk budget alone")
    return notes


# ---- the first guess ---------------------------------------------------------

def ceiling_factors(base: ServeConfig, trace: list[TraceRequest], cands: list[Candidate],
                    slo: Slo) -> list[float]:
    """Each candidate's first probe, as a rate factor: what its engines could
    sustain by the cost model alone (every reusable prefix cached, decode
    batches as large as TPOT and KV pages allow, no queueing). An
    optimistic ceiling: the real boundary lies below, and probes past it
    stop early."""
    s = base.simulate
    cost = simulated_cost(s.gpu, s.model, s.profile)[1]
    eng = base.engine
    seen: set = set()
    fresh = []                                  # (cached tokens, prompt tokens)
    out_tokens = contexts = 0.0
    for t in trace:
        length = len(t.prompt)  # type: ignore[arg-type]
        cached = 0
        ids = getattr(t.prompt, "hash_ids", None)
        if ids is not None:
            run = 0
            while run < len(ids) and ids[run] in seen:
                run += 1
            cached = min(run * t.prompt.block_tokens, length - 1)  # type: ignore[attr-defined]
            seen.update(ids)
        fresh.append((cached, length))
        out = t.output_tokens or t.max_new_tokens or 1
        out_tokens += out
        contexts += length + out / 2
    n = len(trace)
    mean_out, mean_ctx = out_tokens / n, contexts / n

    def prefill_s(chunk: int) -> float:
        total = 0.0
        for begin, end in fresh:
            while begin < end:
                step = min(chunk, end - begin)
                total += cost.round_seconds([(begin, step)], 0, 0)
                begin += step
        return total / n

    kv_tokens = eng.total_pages * eng.page_size
    batch = 1
    while (batch < eng.max_batch_size and (batch + 1) * mean_ctx <= kv_tokens
           and cost.round_seconds([], int((batch + 1) * mean_ctx), batch + 1) <= slo.tpot_s):
        batch += 1
    decode_s = mean_out * cost.round_seconds([], int(batch * mean_ctx), batch) / batch
    per_chunk = {c: prefill_s(c) for c in sorted({c.chunk for c in cands})}
    native = native_rate(trace)
    rates: list[float] = []
    for c in cands:
        p = per_chunk[c.chunk]
        rate = (c.fused / (p + decode_s) if c.fused
                else min(c.prefill / p, c.decode / decode_s))
        rates.append(rate / native)
    return rates


# ---- the search ---------------------------------------------------------------

class Status(enum.Enum):
    SEARCHING = "searching"
    CONVERGED = "converged"       # hi / lo within the tolerance
    DOMINATED = "dominated"       # fails at a rate another candidate passes
    INFEASIBLE = "infeasible"     # fails even RANGE x below its start
    UNBOUNDED = "unbounded"       # passes even RANGE x above its start


@dataclass
class Bracket:
    """One candidate's bisection: `lo` the fastest passing probe, `hi` the
    slowest failing one; every probe lands strictly between them."""
    candidate: Candidate
    start: float
    probes: list = field(default_factory=list)
    lo: Probe | None = None
    hi: Probe | None = None
    status: Status = Status.SEARCHING

    def next_factor(self, tolerance: float, rival: float = 0.0) -> float | None:
        """The next rate factor to probe, or None (and a final status).
        `rival`: the best passing factor of any other candidate (0: none
        yet). Failing at or below it means this one cannot win, so while
        this one is not within `tolerance` of it, the rival's rate is the
        probe that decides: pass and race on, or fail and drop out."""
        if self.status is not Status.SEARCHING:
            return None
        if self.hi is not None and self.hi.factor <= rival:
            self.status = Status.DOMINATED
            return None
        if rival > 0 and (self.lo is None or rival > self.lo.factor * (1 + tolerance)):
            return rival
        if not self.probes:
            return self.start
        if self.lo is None:
            f = self.hi.factor / DOWN  # type: ignore[union-attr]
            if f < self.start / RANGE:
                self.status = Status.INFEASIBLE
                return None
            return f
        if self.hi is None:
            f = self.lo.factor * UP
            if f > self.start * RANGE:
                self.status = Status.UNBOUNDED
                return None
            return f
        if self.hi.factor <= self.lo.factor * (1 + tolerance):
            self.status = Status.CONVERGED
            return None
        return math.sqrt(self.lo.factor * self.hi.factor)

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)
        if probe.passed:
            self.lo = probe
        else:
            self.hi = probe

    @property
    def goodput_factor(self) -> float:
        return self.lo.factor if self.lo else 0.0

    @property
    def ceiling(self) -> float:
        """The most this candidate could still turn out to sustain."""
        if self.hi is not None:
            return self.hi.factor
        return math.inf if self.lo is not None else self.start


def rivals(brackets: list[Bracket]) -> list[float]:
    """For each candidate, the best passing factor among the others."""
    passing = [b.goodput_factor for b in brackets]
    order = sorted(range(len(passing)), key=lambda i: -passing[i])
    top = order[0] if order else None
    second = passing[order[1]] if len(order) > 1 else 0.0
    return [second if i == top else passing[top] for i in range(len(passing))]  # type: ignore[index]


def search(cands: list[Candidate], starts: list[float], submit, collect, tolerance: float,
           width: int) -> list[Bracket]:
    """Branch and bound, best first, `width` probes in flight: whenever a
    slot is free, the live candidate with the highest ceiling that has no
    probe in flight gets its next one, so the leaders' passing rates are
    known before the others are tested against them (`Bracket.next_factor`).
    `submit(index, factor)` starts a probe and returns a handle;
    `collect(handle)` waits for its probe.

    Results are taken in the order the probes were started, and every
    decision reads only those taken, so a given `width` gives the same
    probes on every run, whichever finishes first. A candidate is dropped
    only when it fails at a rate another passes, so the winner is the same
    whatever `width`; its rate may differ within `tolerance`."""
    brackets = [Bracket(c, s) for c, s in zip(cands, starts)]
    flight: deque = deque()                    # (candidate index, handle), oldest first
    while True:
        while len(flight) < width:
            busy = {i for i, _ in flight}
            ready = [(i, f) for i, (b, r) in enumerate(zip(brackets, rivals(brackets)))
                     if i not in busy and (f := b.next_factor(tolerance, r)) is not None]
            if not ready:
                break
            i, f = min(ready, key=lambda job: (-brackets[job[0]].ceiling, job[0]))
            flight.append((i, submit(i, f)))
        if not flight:
            return brackets
        i, handle = flight.popleft()
        brackets[i].record(collect(handle))


# ---- the whole plan -------------------------------------------------------------

@dataclass
class PlanResult:
    settings: Settings
    requests: int
    native_rate: float
    brackets: list[Bracket]
    wall_s: float

    def ranked(self) -> list[Bracket]:
        """Best goodput first; at equal goodput the higher attainment there
        (more headroom), then the candidates' order."""
        order = {id(b): i for i, b in enumerate(self.brackets)}
        return sorted(self.brackets, key=lambda b: (
            -b.goodput_factor, -(b.lo.attainment if b.lo else 0.0), order[id(b)]))

    @property
    def best(self) -> Bracket | None:
        top = self.ranked()[0]
        return top if top.lo is not None else None


def make_plan(base: ServeConfig, trace: list[TraceRequest], settings: Settings, pool,
              progress: bool = True, disaggregated: bool | None = None) -> PlanResult:
    """`disaggregated`: only the P:D splits (True), only fused engines
    (False), or every candidate (None)."""
    from tqdm import tqdm

    if not trace:
        raise ConfigError("the trace has no requests; pass a trace with at least one")
    started = time.perf_counter()
    cands = [c for c in candidates(settings.gpus, settings.chunks)
             if disaggregated is None or disaggregated == (c.fused == 0)]
    configs = [c.config(base) for c in cands]
    starts = ceiling_factors(base, trace, cands, settings.slo)
    bar = tqdm(disable=not progress, unit="sim", desc="pdserve plan", file=sys.stderr)

    def collect(handle):
        probe = pool.result(handle)
        bar.update(1)
        return probe

    try:
        brackets = search(cands, starts, lambda i, f: pool.submit(configs[i], f), collect,
                          settings.tolerance, settings.width)
    finally:
        bar.close()
    return PlanResult(settings, len(trace), native_rate(trace), brackets,
                      time.perf_counter() - started)
