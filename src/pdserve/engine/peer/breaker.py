"""D's circuit breaker per P engine: after its transfers keep failing (the
landing timed out, P unreachable or silent) D stops asking that P and
prefills the requests paired with it itself, until a single probe lands.

A P that is alive but behind a slow or lossy link (or a half-frozen one)
answers the router's probes and stays in rotation, yet every ask of it
waits out the landing timeout before D prefills locally: each request pays
`transfer.timeout_s` on top of a local prefill. With the breaker, after
`THRESHOLD` failures in a row D asks that P nothing for a cooldown (the
landing timeout); then one request (the probe) is asked of it while the
rest are prefilled here: a probe that lands closes the breaker, one that
fails opens it again. An ask that was out when it opened and fails later
changes nothing. Pure bookkeeping on the loop thread."""

from __future__ import annotations

from dataclasses import dataclass

# failures in a row (no write of that P's landing between them) that open
# it: one or two can be those requests' own (a fault on their transfers, as
# the chaos suite injects); three with nothing landing between are the P or
# its link
THRESHOLD = 3


@dataclass
class _Peer:
    failures: int = 0            # in a row
    open_until: float = 0.0      # no ask until then (0: closed)
    probe_until: float = 0.0     # a probe is out until then (its answer or its timeout)


class PrefillBreaker:
    def __init__(self, cooldown_s: float, probe_s: float):
        """`cooldown_s`: how long it stays open; `probe_s`: how
        long a probe may take before another is let through (the landing
        timeout and then some: a probe that was aborted never answers)."""
        self.cooldown_s, self.probe_s = cooldown_s, probe_s
        self._peers: dict[str, _Peer] = {}

    def allows(self, peer: str, now: float) -> bool:
        """Whether to ask `peer` for a prompt now (False: prefill it here)."""
        p = self._peers.get(peer)
        if p is None or not p.open_until:
            return True
        if now < p.open_until or now < p.probe_until:
            return False
        p.probe_until = now + self.probe_s               # half open: this ask is the probe
        return True

    def close(self, peer: str) -> None:
        """A write from `peer` landed, or a new incarnation of it joined."""
        self._peers.pop(peer, None)

    def failed(self, peer: str, now: float) -> None:
        p = self._peers.setdefault(peer, _Peer())
        if now < p.open_until:
            return                       # asked before it opened: nothing new
        p.failures += 1
        if p.failures >= THRESHOLD:
            p.open_until, p.probe_until = now + self.cooldown_s, 0.0
