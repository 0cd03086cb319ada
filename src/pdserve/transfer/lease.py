"""P's leases: a silent peer cannot keep P's pages pinned forever.

Every request P holds for a peer carries a deadline. The peer's heartbeat
(one message per peer, naming every request it still waits on) renews
them; a request whose deadline passes is let go: no more renewals and no
more posts, and its pages are released once no write of it still reads
them (engine/peer/protocol.py drains it). Time is passed in, so the table is
deterministic under test.
"""

from __future__ import annotations

DEFAULT_LEASE_S = 10.0


class LeaseTable:
    def __init__(self, lease_s: float = DEFAULT_LEASE_S):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._deadline: dict[str, float] = {}
        self._peer: dict[str, object] = {}
        self.expiries = 0

    def grant(self, req_id: str, peer, now: float) -> None:
        self._deadline[req_id] = now + self.lease_s
        self._peer[req_id] = peer

    def renew(self, peer, req_ids, now: float) -> int:
        """A heartbeat from `peer`; returns how many leases it renewed. Ids
        held for another peer are not touched, and neither is a lease whose
        deadline passed: an expiry is final even before `expired` sweeps it
        (a heartbeat that waited out a freeze in P's queue, or a late one
        from D, must not revive a twin D may have given up on)."""
        n = 0
        for rid in req_ids:
            if self._peer.get(rid) == peer and self._deadline[rid] > now:
                self._deadline[rid] = now + self.lease_s
                n += 1
        return n

    def holds(self, req_id: str, now: float) -> bool:
        """Is the lease still good (a write may be posted under it)?"""
        return self._deadline.get(req_id, -1.0) > now

    def release(self, req_id: str) -> None:
        self._deadline.pop(req_id, None)
        self._peer.pop(req_id, None)

    def expired(self, now: float) -> list[str]:
        out = [rid for rid, t in self._deadline.items() if t <= now]
        for rid in out:
            self.release(rid)
        self.expiries += len(out)
        return out

    def __len__(self) -> int:
        return len(self._deadline)
