"""The P/D timeouts and the relations between them that keep pages safe.

    transfer_s   D: how long a landing waits for P's write before D gives up
    lease_s      P: how long it keeps a twin for D without a word from D
    heartbeat_s  D: how often it renews the leases of what it still waits on

Who holds which page until when (docs/reliability.md, "Leases and fences"):
P posts a write only while its lease holds (an expired lease is never
renewed), and keeps the source pages pinned until the transport says the
write ended (done, failed or cancelled), however long after the lease that
is. D, giving up on a landing (its timeout, an abort, an unreachable P),
quarantines the landing pages until the write's notification drains them,
P reports that no write of that landing is left, or that P incarnation is
gone. No timeout here frees them: a frozen P or a stalled link can hold a
posted write for longer than any of these values (transfer/landing.py).
What `problems` checks is the one relation the values must keep.
"""

from __future__ import annotations

from dataclasses import dataclass

# how each field is spelt in the config file (config/serve.py, `transfer:`)
CONFIG_NAMES = {"transfer_s": "transfer.timeout_s", "lease_s": "transfer.lease_s",
                "heartbeat_s": "transfer.heartbeat_s"}
# and as an engine option (cluster/actors.py `build_engine_server`, Deployment's
# engine_options)
OPTION_NAMES = {"transfer_s": "transfer_timeout_s", "lease_s": "lease_s",
                "heartbeat_s": "heartbeat_s"}


@dataclass(frozen=True)
class PeerTimeouts:
    transfer_s: float = 30.0    # D: how long a landing waits for P's write
    lease_s: float = 10.0       # P: how long it pins a twin's pages without a word from D
    heartbeat_s: float = 2.0    # D: how often it renews the leases of what it waits on

    def problems(self, names: dict[str, str] = OPTION_NAMES) -> list[str]:
        """What is wrong with these values, each with what to change (empty:
        nothing). `names`: how the caller's user spells each field."""
        out = []
        for f in ("transfer_s", "lease_s", "heartbeat_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                out.append(f"{names[f]} must be a number of seconds > 0, got {v!r}")
        if out:
            return out
        hb, lease = names["heartbeat_s"], names["lease_s"]
        if 2 * self.heartbeat_s > self.lease_s:
            out.append(
                f"{hb}={self.heartbeat_s:g} is more than half of {lease}={self.lease_s:g}: "
                f"a decode engine renews prefill engines' leases once every {hb}, so a "
                "single late or lost heartbeat would let a lease run out while the decode "
                "engine still waits for the write, and the prefill engine would drop work "
                f"it is owed; make {hb} at most {lease}/2 (lower {hb} or raise {lease})")
        return out

    def check(self, names: dict[str, str] = OPTION_NAMES) -> "PeerTimeouts":
        """Self, or ValueError naming every problem."""
        p = self.problems(names)
        if p:
            raise ValueError("; ".join(p))
        return self
