"""Fault injection inside the transport, driven by config or a test API
(never by environment variables read at import).

A rule fails, delays or drops a transfer at one stage:
  post          P hands the write to the backend
  completion    P learns the write finished
  notification  D learns the write landed
  ack           D's acknowledgement to P (applied by the control plane)
for one request id, or for each transfer with a probability (seeded).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

STAGES = ("post", "completion", "notification", "ack")
ACTIONS = ("fail", "delay", "drop")


@dataclass
class FaultRule:
    stage: str
    action: str
    req_id: str | None = None        # None: every request, with `probability`
    probability: float = 1.0
    delay_s: float = 0.0
    times: int = 1                   # how often it fires (0: without end)

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"fault stage {self.stage!r}: use one of {', '.join(STAGES)}")
        if self.action not in ACTIONS:
            raise ValueError(f"fault action {self.action!r}: use one of {', '.join(ACTIONS)}")
        if not 0 <= self.probability <= 1:
            raise ValueError(f"fault probability {self.probability} must be in [0, 1]")
        if self.action == "delay" and self.delay_s <= 0:
            raise ValueError("a delay fault needs delay_s > 0")
        if not isinstance(self.times, int) or self.times < 0:
            raise ValueError(f"fault times={self.times!r}: give a count >= 1, or 0 for "
                             "without end")


class FaultInjector:
    def __init__(self, rules=(), seed: int = 0):
        self.rules = list(rules)
        self._rng = random.Random(seed)
        self.fired: list[tuple[str, str, str]] = []   # (stage, action, req_id)

    def add(self, rule: FaultRule) -> None:
        self.rules.append(rule)

    @classmethod
    def from_config(cls, entries: list[dict], seed: int = 0) -> "FaultInjector":
        return cls([FaultRule(**e) for e in entries], seed)

    def match(self, stage: str, req_id: str, actions=ACTIONS) -> FaultRule | None:
        """The first live rule for this stage and request whose action can
        apply here (`actions`); firing it uses up one of its `times`."""
        for rule in self.rules:
            if rule.stage != stage or (rule.req_id is not None and rule.req_id != req_id):
                continue
            if rule.action not in actions:
                continue
            if rule.times == -1:
                continue                       # spent
            if rule.probability < 1 and self._rng.random() >= rule.probability:
                continue
            if rule.times > 0:
                rule.times -= 1
                if rule.times == 0:
                    rule.times = -1
            self.fired.append((stage, rule.action, req_id))
            return rule
        return None
