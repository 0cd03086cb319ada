"""D's landing table: which write may reach which landing pages, and the
quarantine that keeps pages out of reuse while a write might still arrive.

A posted RDMA write cannot be recalled, and no clock on D bounds when it
ends: P may be frozen with the write queued (a GC or swap pause, SIGSTOP),
or the link may stall and heal a minute later. So when D gives up on a
landing (a timeout, an abort, an unreachable P) the pages are fenced, not
freed, and stay quarantined until one of:

- the write's notification arrives (it landed: nothing more of it comes);
- P reports that no write of this landing is in flight or will be posted
  (`ended`: P's TransferEnded, which its transport's own state backs);
- the P incarnation asked is known to be gone (`sources_gone`: membership
  introduced a newer incarnation of that engine, or removed it).

D names its quarantined landings in every heartbeat to their P, so a lost
report is asked for again. A notification for a fenced epoch is late: it
drains the quarantine and is never read as another request's KV. A new
attempt for the same request is a new epoch, so it can never be mistaken
for the old one; and each landing remembers the P incarnation asked, so a
report from any other (an older one that outlived its restart) is not
taken for it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.transfer.transport import Incarnation


class LandingVerdict(enum.Enum):
    """What D makes of a write's notification (`LandingTable.on_notification`)."""
    LANDED = "landed"       # expected: deliver the KV and the first token
    DRAINED = "drained"     # a quarantined write finished: its pages may go now
    STALE = "stale"         # nothing expects it (an ended epoch, another writer): drop it


@dataclass
class Landing:
    req_id: str
    epoch: int
    pages: tuple
    source: Incarnation         # the P incarnation asked to write it
    deadline: float             # give up waiting for the write at this time
    fenced: bool = False        # given up on: quarantined until the write is known over


class LandingTable:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._by_key: dict[tuple[str, int], Landing] = {}
        self._epoch = 0

    def expect(self, req_id: str, pages, now: float, source: Incarnation) -> int:
        """A new landing for `req_id`, asked of `source`; returns its epoch."""
        self._epoch += 1
        self._by_key[(req_id, self._epoch)] = Landing(req_id, self._epoch, tuple(pages), source,
                                                      now + self.timeout_s)
        return self._epoch

    def get(self, req_id: str, epoch: int) -> Landing | None:
        return self._by_key.get((req_id, epoch))

    def on_notification(self, req_id: str, epoch: int, source: Incarnation) -> LandingVerdict:
        """The landing `epoch` of `req_id` heard from a write by `source`."""
        ld = self._by_key.get((req_id, epoch))
        if ld is None or ld.source != source:
            return LandingVerdict.STALE
        del self._by_key[(req_id, epoch)]
        return LandingVerdict.DRAINED if ld.fenced else LandingVerdict.LANDED

    def fence(self, req_id: str, epoch: int) -> Landing | None:
        """Stop expecting this landing; quarantine its pages until the write
        is known over. None if it is not live or fenced already."""
        ld = self._by_key.get((req_id, epoch))
        if ld is None or ld.fenced:
            return None
        ld.fenced = True
        return ld

    def forget(self, req_id: str, epoch: int) -> bool:
        """A landing no write will reach (P refused the ask, or the ask was
        never sent) and not yet fenced: it goes, without a quarantine."""
        ld = self._by_key.get((req_id, epoch))
        if ld is None or ld.fenced:
            return False
        del self._by_key[(req_id, epoch)]
        return True

    def ended(self, req_id: str, epoch: int, source: Incarnation) -> Landing | None:
        """`source` says no write of this landing is in flight or will be
        posted: the landing goes (fenced or not) and is returned; None if
        it is not live or `source` is not the P it was asked of."""
        ld = self._by_key.get((req_id, epoch))
        if ld is None or ld.source != source:
            return None
        del self._by_key[(req_id, epoch)]
        return ld

    def sources_gone(self, engine_id: str, before: int | None = None) -> list[Landing]:
        """The P engine `engine_id` restarted at incarnation `before` (None:
        it is gone altogether): its older incarnations write nothing more.
        Their landings go and are returned, fenced or not."""
        out = [ld for ld in self._by_key.values() if ld.source.engine_id == engine_id
               and (before is None or ld.source.epoch < before)]
        for ld in out:
            del self._by_key[(ld.req_id, ld.epoch)]
        return out

    def timed_out(self, now: float) -> list[Landing]:
        return [ld for ld in self._by_key.values() if not ld.fenced and ld.deadline <= now]

    def quarantined(self) -> list[Landing]:
        """The fenced landings, oldest first."""
        return [ld for ld in self._by_key.values() if ld.fenced]

    def __len__(self) -> int:
        return len(self._by_key)
