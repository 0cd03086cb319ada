"""The speculation gate: each engine proposes candidates only while doing
so delivers more tokens for its cost than not doing so, at the batch it
runs.

Speculation trades compute for latency: a verify row scores 1 + k positions
to keep a + 1 of them. At a small batch the forward is bound by reading
the weights and the extra positions are nearly free; at a large one it is
bound by compute and every rejected position is paid for (vLLM's n-gram
loses 1.4x at high load). The gate decides per batch bucket (a power of
two of the decode batch), in three steps:

- **Prior.** The first time a bucket is seen, a cost model picks the side:
  a verify gives `acceptance` tokens a row (the engine's measured mean
  acceptance length, or `default_acceptance` before any verify) for
  (F + B(1 + k)) / (F + B) times a decode's cost, F being the rows a
  forward scores for about the price of reading the weights once
  (`free_rows`). Where the expected gain is below 1 + `prior_margin`,
  speculation starts off; below `prior_sure`, its first probe waits four
  times as long.
- **Measure.** Every decode-only round reports its delivered tokens
  (accepted candidates included) and its cost: the engine process's CPU
  seconds (every thread's) when given, else wall seconds. On a host shared
  with other processes, CPU time moves far less with their load than wall
  time does, so rounds measured minutes apart compare. Each side keeps an
  exponential average of tokens and of cost.
- **Probe.** After `probe_first` rounds on a side, the gate runs the
  other side until it has `probe_rounds` rounds of it (a verify lands one
  round after proposing starts, so the first round of a probe may still be
  the old side; it is not counted), then compares the probe's tokens per
  cost with the chosen side's average. It switches only if the other side
  is ahead by `margin` (hysteresis), and only once a probe extended to
  twice its rounds still says so (one noisy probe does not flip it). A probe that confirms the choice
  doubles the wait before the next one, up to `probe_max` rounds, so
  probes cost little in a steady regime; a switch resets it, so a regime
  change is seen within `probe_max` + a probe.

Pure: it reads no clock; the executor passes what it measured, tests pass
whatever they like, and the same inputs give the same decisions. The last
`log_limit` rounds it saw are kept (`take_log`), for the benchmark.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class GateMode(enum.StrEnum):
    ON = "on"               # proposing candidates
    OFF = "off"             # decoding one token a round
    PROBE_ON = "probe_on"   # measuring speculation while off
    PROBE_OFF = "probe_off"  # measuring without it while on


def bucket(batch: int) -> int:
    """The decode batch's bucket: the power of two at or below it."""
    return 1 << (max(batch, 1).bit_length() - 1)


def prior_gain(batch: int, k: int, acceptance: float, free_rows: float) -> float:
    """Tokens for cost of a verify round against a decode round, by the cost
    model: a verify gives `acceptance` tokens a row (a decode one) and
    scores 1 + k rows where a decode scores one; a forward of r rows
    costs about free_rows + r."""
    return acceptance * (free_rows + batch) / (free_rows + batch * (1 + k))


@dataclass(frozen=True)
class GateRound:
    """One decode-only round as the gate saw it."""
    index: int              # the gate's round count when it came
    speculating: bool       # it verified candidates
    batch: int              # decodes in it
    tokens: int             # tokens they delivered
    cpu_s: float | None     # the engine process's CPU seconds (None: not measured)
    wall_s: float
    mode: GateMode          # the gate's mode once it had decided on this round


@dataclass
class SideCost:
    """Exponential averages of one side's tokens and cost a round."""
    tokens: float = 0.0
    cost: float = 0.0
    samples: int = 0

    def add(self, tokens: float, cost: float, smoothing: float) -> None:
        if self.samples == 0:
            self.tokens, self.cost = tokens, cost
        else:
            self.tokens += smoothing * (tokens - self.tokens)
            self.cost += smoothing * (cost - self.cost)
        self.samples += 1

    @property
    def rate(self) -> float:
        """Tokens per second of cost; 0: unmeasured."""
        return self.tokens / self.cost if self.cost > 0 else 0.0


@dataclass
class BucketState:
    chosen: bool                    # the side outside probes (True: speculate)
    prior: float                    # the cost model's gain when the bucket was first seen
    sides: dict = field(default_factory=lambda: {True: SideCost(), False: SideCost()})
    interval: int = 0               # rounds on the chosen side before the next probe
    since: int = 0                  # rounds since the last probe ended (or the bucket began)
    probing: bool = False
    probe_rounds: int = 0           # rounds of the probed side seen in this probe
    probe_target: int = 0           # rounds it needs (doubled to confirm a switch)
    probe_seen: int = 0             # rounds of any side since this probe began
    probe_tokens: float = 0.0
    probe_cost: float = 0.0
    probes: int = 0
    switches: int = 0


class SpecGate:
    def __init__(self, k: int = 3, *, probe_first: int = 32, probe_max: int = 512,
                 probe_rounds: int = 6, margin: float = 0.05, smoothing: float = 0.1,
                 free_rows: float = 8.0, default_acceptance: float | None = None,
                 prior_margin: float = 0.1, prior_sure: float = 0.8, log_limit: int = 4096):
        if probe_rounds < 1 or probe_first < 1 or probe_max < probe_first:
            raise ValueError("SpecGate: need probe_rounds >= 1 and 1 <= probe_first <= probe_max")
        self.k = k
        self.probe_first = probe_first
        self.probe_max = probe_max
        self.probe_rounds = probe_rounds
        self.margin = margin
        self.smoothing = smoothing
        self.free_rows = free_rows
        # before any verify: half the candidates accepted (a workload that
        # repeats its input does better; one that does not, far worse)
        self.default_acceptance = default_acceptance if default_acceptance is not None \
            else 1 + k / 2
        self.prior_margin = prior_margin
        self.prior_sure = prior_sure
        self.buckets: dict[int, BucketState] = {}
        self.mode = GateMode.ON
        self.rounds = 0             # decode-only rounds observed
        self.switches = 0           # times a bucket's chosen side changed
        self._bucket = 1
        self._log: deque[GateRound] = deque(maxlen=log_limit)

    @property
    def on(self) -> bool:
        return self.mode in (GateMode.ON, GateMode.PROBE_ON)

    def observe(self, speculating: bool, batch: int, tokens: int, seconds: float,
                cpu_seconds: float | None = None, acceptance: float = 0.0) -> None:
        """A decode-only round of `batch` decodes delivered `tokens` in
        `seconds` of wall time and `cpu_seconds` of the engine process's
        CPU time (None: not measured; wall time is the cost then);
        `speculating`: it verified candidates; `acceptance`: the engine's
        mean acceptance length so far (0: no verify yet)."""
        cost = cpu_seconds if cpu_seconds is not None and cpu_seconds > 0 else seconds
        if batch < 1 or not cost > 0:
            return
        b = bucket(batch)
        st = self.buckets.get(b)
        if st is None:
            gain = prior_gain(b, self.k, acceptance or self.default_acceptance, self.free_rows)
            # where the model says speculation cannot pay, the first probe waits longer
            first = self.probe_first * (4 if gain < self.prior_sure else 1)
            st = self.buckets[b] = BucketState(chosen=gain >= 1 + self.prior_margin,
                                               prior=gain, interval=min(first, self.probe_max))
        st.sides[speculating].add(tokens, cost, self.smoothing)
        self._bucket = b
        self._decide(st, speculating, tokens, cost)
        self._log.append(GateRound(self.rounds, speculating, batch, tokens, cpu_seconds,
                                   seconds, self.mode))
        self.rounds += 1

    def _decide(self, st: BucketState, speculating: bool, tokens: int, cost: float) -> None:
        if st.probing:
            st.probe_seen += 1
            if speculating != st.chosen:
                st.probe_rounds += 1
                st.probe_tokens += tokens
                st.probe_cost += cost
            # a side that cannot be run (no request has candidates) ends the
            # probe after twice its rounds, inconclusive
            if st.probe_rounds >= st.probe_target or st.probe_seen >= 2 * st.probe_target + 2:
                self._end_probe(st)
        else:
            st.since += 1
            if st.since >= st.interval:
                st.probing, st.probes = True, st.probes + 1
                st.probe_rounds = st.probe_seen = 0
                st.probe_target = self.probe_rounds
                st.probe_tokens = st.probe_cost = 0.0
        self._set(st)

    def _end_probe(self, st: BucketState) -> None:
        if st.probe_rounds < st.probe_target:
            st.probing, st.since = False, 0
            return
        probed = st.probe_tokens / st.probe_cost
        kept = st.sides[st.chosen].rate
        ahead = kept > 0 and probed > kept * (1 + self.margin)
        if ahead and st.probe_target == self.probe_rounds:
            st.probe_target = 2 * self.probe_rounds     # confirm on twice the rounds
            return
        st.probing, st.since = False, 0
        if ahead:
            st.chosen = not st.chosen
            st.switches += 1
            self.switches += 1
            st.interval = self.probe_first
        else:
            st.interval = min(2 * st.interval, self.probe_max)

    def _set(self, st: BucketState) -> None:
        if st.probing:
            self.mode = GateMode.PROBE_OFF if st.chosen else GateMode.PROBE_ON
        else:
            self.mode = GateMode.ON if st.chosen else GateMode.OFF

    def rates(self) -> tuple[float, float]:
        """(tokens a second of cost with speculation, without it) in the
        bucket last run; 0: unmeasured."""
        st = self.buckets.get(self._bucket)
        if st is None:
            return 0.0, 0.0
        return st.sides[True].rate, st.sides[False].rate

    def take_log(self) -> list[GateRound]:
        """The rounds seen since the last call (at most `log_limit`), oldest first."""
        out = list(self._log)
        self._log.clear()
        return out
