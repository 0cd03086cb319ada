"""D's landing table: which write may reach which landing pages, and the
fence that keeps pages out of reuse while a write might still arrive.

A posted RDMA write cannot be recalled. So when D gives up on a landing (a
timeout, a reported failure, an abort) while P may still be writing, the
pages are fenced, not freed: they stay held until the write's notification
drains them, or until no write can still arrive: P's lease has run out (P
posts nothing after it) and a write posted just before has had as long as
D waits for one (`PeerTimeouts.fence_s`, the margin passed in here). A notification for a
fenced epoch is late: it is dropped, never read as another request's KV.
A new attempt for the same request is a new epoch, so it can never be
mistaken for the old one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LandingVerdict(enum.Enum):
    """What D makes of a write's notification (`LandingTable.on_notification`)."""
    LANDED = "landed"       # expected: deliver the KV and the first token
    DRAINED = "drained"     # a fenced write finished: its pages may go now
    STALE = "stale"         # nothing expects it (an ended epoch): drop it


@dataclass
class Landing:
    req_id: str
    epoch: int
    pages: tuple
    deadline: float             # give up waiting for the write at this time
    fenced: bool = False
    release_at: float = 0.0     # fenced: free the pages at this time at the latest


class LandingTable:
    def __init__(self, timeout_s: float, lease_s: float, margin_s: float | None = None):
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        # past P's lease, a heartbeat sent just before the fence may still renew
        # it, and a write posted just before expiry may still be in flight; the
        # engine passes PeerTimeouts.fence_margin_s (heartbeat + landing timeout)
        self.margin_s = lease_s if margin_s is None else margin_s
        self._by_key: dict[tuple[str, int], Landing] = {}
        self._epoch = 0

    def expect(self, req_id: str, pages, now: float) -> int:
        """A new landing for `req_id`; returns its epoch."""
        self._epoch += 1
        self._by_key[(req_id, self._epoch)] = Landing(req_id, self._epoch, tuple(pages),
                                                      now + self.timeout_s)
        return self._epoch

    def on_notification(self, req_id: str, epoch: int) -> LandingVerdict:
        """The landing `epoch` of `req_id` heard from its write."""
        ld = self._by_key.get((req_id, epoch))
        if ld is None:
            return LandingVerdict.STALE
        del self._by_key[(req_id, epoch)]
        return LandingVerdict.DRAINED if ld.fenced else LandingVerdict.LANDED

    def fence(self, req_id: str, epoch: int, now: float) -> Landing | None:
        """Stop expecting this landing; keep its pages until the write
        drains or the lease runs out."""
        ld = self._by_key.get((req_id, epoch))
        if ld is None or ld.fenced:
            return None
        ld.fenced = True
        ld.release_at = now + self.lease_s + self.margin_s
        return ld

    def forget(self, req_id: str, epoch: int) -> bool:
        """The write is known never to land (P reported it failed): no fence."""
        return self._by_key.pop((req_id, epoch), None) is not None

    def timed_out(self, now: float) -> list[Landing]:
        return [ld for ld in self._by_key.values() if not ld.fenced and ld.deadline <= now]

    def expired_fences(self, now: float) -> list[Landing]:
        """Fenced landings whose lease ran out: the pages may go now."""
        out = [ld for ld in self._by_key.values() if ld.fenced and ld.release_at <= now]
        for ld in out:
            del self._by_key[(ld.req_id, ld.epoch)]
        return out

    def __len__(self) -> int:
        return len(self._by_key)
