"""The speculation gate: each engine proposes candidates only while doing
so delivers more tokens a second than not doing so, at the batch it runs.

Speculation trades compute for latency: a verify row scores 1 + k positions
to keep a + 1 of them. At a small batch the forward is bound by reading
the weights and the extra positions are nearly free; at a large one it is
bound by compute and every rejected position is paid for (vLLM's n-gram
loses 1.4x at high load). So the gate measures both, per batch bucket (a
power of two of the decode batch): every decode-only round reports its
delivered tokens (every token the round's decodes gave, accepted
candidates included), its wall time, and whether it verified anything; an
exponential average of tokens/s is kept for each side. The gate then runs
the side that delivers more, switching only when the other is ahead by
`margin`, and every `probe_every` rounds in a bucket it runs `probe_rounds`
rounds of the side it is not on, so a change of workload is seen. A side
never measured in a bucket is measured first (speculation on, then off).

Pure: it reads no clock; the executor passes what it measured, and tests
pass whatever they like.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class GateMode(enum.StrEnum):
    ON = "on"               # proposing candidates
    OFF = "off"             # decoding one token a round
    PROBE_ON = "probe_on"   # measuring speculation while off
    PROBE_OFF = "probe_off"  # measuring without it while on


def bucket(batch: int) -> int:
    """The decode batch's bucket: the power of two at or below it."""
    return 1 << (max(batch, 1).bit_length() - 1)


@dataclass
class BucketRates:
    rate: dict = field(default_factory=dict)        # speculating (bool) -> tokens/s average
    samples: dict = field(default_factory=dict)     # speculating -> rounds measured
    last: dict = field(default_factory=dict)        # speculating -> the gate round it was last seen


class SpecGate:
    def __init__(self, probe_every: int = 200, probe_rounds: int = 8, margin: float = 0.03,
                 smoothing: float = 0.25):
        self.probe_every = probe_every
        self.probe_rounds = probe_rounds
        self.margin = margin
        self.smoothing = smoothing
        self.buckets: dict[int, BucketRates] = {}
        self.mode = GateMode.ON
        self.rounds = 0             # decode-only rounds observed
        self.switches = 0           # times the chosen side changed
        self._probe_left = 0
        self._chosen = True         # the side outside probes
        self._bucket = 1

    @property
    def on(self) -> bool:
        return self.mode in (GateMode.ON, GateMode.PROBE_ON)

    def observe(self, speculating: bool, batch: int, tokens: int, seconds: float) -> None:
        """A decode-only round of `batch` decodes delivered `tokens` in
        `seconds`; `speculating`: it verified candidates."""
        if batch < 1 or not seconds > 0:
            return
        b = bucket(batch)
        st = self.buckets.setdefault(b, BucketRates())
        rate = tokens / seconds
        old = st.rate.get(speculating)
        st.rate[speculating] = rate if old is None else old + self.smoothing * (rate - old)
        st.samples[speculating] = st.samples.get(speculating, 0) + 1
        st.last[speculating] = self.rounds
        self.rounds += 1
        self._bucket = b
        self._decide(st)

    def _decide(self, st: BucketRates) -> None:
        if self._probe_left:
            self._probe_left -= 1
            if self._probe_left:
                return
        for side in (True, False):       # a side not yet measured here is measured first
            if st.samples.get(side, 0) < self.probe_rounds:
                self._set(side, probe=side != self._chosen)
                return
        other = not self._chosen
        if self.rounds - st.last.get(other, 0) >= self.probe_every:
            self._probe_left = self.probe_rounds
            self._set(other, probe=True)
            return
        on, off = st.rate[True], st.rate[False]
        if self._chosen and on < off * (1 - self.margin):
            self._chosen = False
            self.switches += 1
        elif not self._chosen and on > off * (1 + self.margin):
            self._chosen = True
            self.switches += 1
        self._set(self._chosen, probe=False)

    def _set(self, side: bool, probe: bool) -> None:
        if probe:
            self.mode = GateMode.PROBE_ON if side else GateMode.PROBE_OFF
        else:
            self.mode = GateMode.ON if side else GateMode.OFF

    def rates(self) -> tuple[float, float]:
        """(tokens/s with speculation, without it) in the bucket last run; 0: unmeasured."""
        st = self.buckets.get(self._bucket)
        if st is None:
            return 0.0, 0.0
        return st.rate.get(True, 0.0), st.rate.get(False, 0.0)
