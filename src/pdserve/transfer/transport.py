"""The transport contract every backend implements.

A transport belongs to one engine incarnation. It registers the engine's KV
pools once (page-major: page i is one contiguous region; one pool per cache
group, each with its own page bytes, numbered one after another so a write
names pages of every group in one list: `page_ids`), publishes metadata
that peers add by incarnation, and moves pages with `write`: P posts a write
of its pages into D's pages, with a notification naming request, epoch and
target incarnation. `poll` reports, on P, each posted write's end, and on D,
each notification that arrived (a write that landed).

A write reads P's source pages from its post until its end, and P must not
free or reuse them before then (the lease bounds when P may *post*, not
how long a posted write runs). So a write P hands to `write` ends in one
event on P, DONE, FAILED or CANCELLED (a fault rule may swallow it, as a
lost completion would be), and until it ends `in_flight(req_id)` is true:
P asks that, not the events, before it lets the pages go. `cancel(req_id)` stops what the backend can
stop; a write it cannot stop keeps running and ends as DONE or FAILED.
D cannot recall a write either; see landing.py for what it does instead.
"""

from __future__ import annotations

import abc
import enum
import time
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Incarnation:
    """An engine at one start: a restart is a new epoch, never the same peer."""
    engine_id: str
    epoch: int

    @property
    def agent_name(self) -> str:
        return f"{self.engine_id}@{self.epoch}"

    @classmethod
    def parse(cls, name: str) -> "Incarnation":
        engine, _, epoch = name.rpartition("@")
        return cls(engine, int(epoch))


@dataclass(frozen=True)
class KvWrite:
    req_id: str
    epoch: int                 # the landing's epoch on D (a retry is a new epoch)
    target: Incarnation        # the D incarnation the pages belong to
    src_pages: tuple           # P's pages, in prompt order
    dst_pages: tuple           # D's landing pages, same length
    first_token: int = -1      # rides on the notification: D needs it with the KV
    payload: bytes = b""       # rides along too (the first token's logprobs), opaque here
    drafts: tuple = ()         # and P's speculative candidates after the first token
    source: Incarnation | None = None   # the P incarnation that writes it (the note says so)


class TransferEventKind(enum.Enum):
    """What `poll` reports: on P, a write completed (DONE), will never land
    (FAILED) or was stopped before it read everything (CANCELLED): each
    means it reads P's source pages no more; on D, a write's notification
    arrived (LANDED)."""
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LANDED = "landed"


@dataclass(frozen=True)
class TransferEvent:
    kind: TransferEventKind
    req_id: str
    epoch: int
    peer: Incarnation          # the other side
    reason: str = ""
    first_token: int = -1      # landed: the token the write carried
    payload: bytes = b""       # landed: what the write carried beside it
    drafts: tuple = ()         # landed: the speculative candidates it carried
    seconds: float = 0.0       # done: post -> completion


@dataclass
class TransferMetrics:
    writes: int = 0
    bytes: int = 0
    descriptors: int = 0             # page runs the writes named (both sides consecutive)
    backend_descriptors: int = 0     # what the backend reports it moved (NIXL telemetry,
                                     # NixlTransport(telemetry=True)); 0 when not captured
    failures: int = 0
    landed: int = 0
    dropped_notifications: int = 0   # late or stale: fenced epoch, old incarnation
    lease_expiries: int = 0
    seconds: float = 0.0             # summed post -> completion time on P
    setup_seconds: float = 0.0       # summed per-transfer setup (no registration, no descs)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def page_runs(src, dst) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both sides are consecutive:
    each is one descriptor on the wire."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            s0, d0, n = runs[-1]
            runs[-1] = (s0, d0, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


class KvTransport(abc.ABC):
    def __init__(self, incarnation: Incarnation, faults=None):
        from pdserve.transfer.faults import FaultInjector

        self.incarnation = incarnation
        self.faults = faults if faults is not None else FaultInjector()
        self.metrics = TransferMetrics()
        self.page_bytes = 0           # group 0's page (the only group of most models)
        self.num_pages = 0
        self.group_page_bytes: list[int] = []
        self.offsets: list[int] = []  # first transport page id of each group's pool
        self._delayed: list = []      # (due, TransferEvent) held back by a delay fault
        self._held: list = []         # (due, KvWrite) whose post a delay fault holds back
        self.layout = None            # KvLayout: what peers compare at the handshake (kv_layout.py)

    def register_pool(self, pool) -> None:
        """Register the page-major KV pool tensor (pages first) once."""
        self.register_pools([pool])

    def register_pools(self, pools, layout=None) -> None:
        """Register one page-major pool per cache group, once. `layout`
        (a KvLayout): what the metadata carries and a peer is checked
        against."""
        self.layout = layout
        self.group_page_bytes = [p[0].numel() * p.element_size() for p in pools]
        self.offsets, n = [], 0
        for p in pools:
            self.offsets.append(n)
            n += p.shape[0]
        self.num_pages = n
        self.page_bytes = self.group_page_bytes[0]
        self._register(list(pools))

    @abc.abstractmethod
    def _register(self, pools: list) -> None:
        ...

    def page_ids(self, per_group) -> tuple:
        """Transport page ids for per-group page lists (this engine's pools)."""
        out: list[int] = []
        for off, pages in zip(self.offsets, per_group):
            out.extend(off + p for p in pages)
        return tuple(out)

    def locate(self, page_id: int) -> tuple[int, int]:
        """(group, page) of a transport page id."""
        import bisect

        g = bisect.bisect_right(self.offsets, page_id) - 1
        return g, page_id - self.offsets[g]

    def bytes_of(self, page_ids) -> int:
        if len(self.group_page_bytes) == 1:
            return len(page_ids) * self.page_bytes
        return sum(self.group_page_bytes[self.locate(p)[0]] for p in page_ids)

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to write into this pool."""

    @abc.abstractmethod
    def add_peer(self, incarnation: Incarnation, metadata: bytes) -> None:
        """Know a peer at this incarnation; forgets any older incarnation of
        the same engine, so nothing meant for it can reach the new one."""

    @abc.abstractmethod
    def remove_peer(self, engine_id: str) -> None:
        ...

    def peer_pages(self, engine_id: str) -> int | None:
        """How many pages the known peer `engine_id` registered (the page
        ids a write may name there); None if not known."""
        return None

    @abc.abstractmethod
    def peers(self) -> list[Incarnation]:
        ...

    @abc.abstractmethod
    def _post(self, w: KvWrite) -> None:
        """Start the write; failures surface through _poll_backend."""

    @abc.abstractmethod
    def _poll_backend(self) -> list[TransferEvent]:
        ...

    @abc.abstractmethod
    def _backend_in_flight(self, req_id: str) -> bool:
        """Has the backend a posted write of `req_id` that has not ended?"""

    def _cancel_posted(self, req_id: str) -> list[KvWrite]:
        """Stop the posted writes of `req_id` that the backend can prove no
        longer read their source; returns them. Default: none can be."""
        return []

    def write(self, w: KvWrite) -> None:
        if len(w.src_pages) != len(w.dst_pages):
            raise ValueError(f"{w.req_id}: {len(w.src_pages)} source pages for "
                             f"{len(w.dst_pages)} destination pages")
        self.metrics.writes += 1
        self.metrics.bytes += self.bytes_of(w.src_pages)
        self.metrics.descriptors += len(page_runs(w.src_pages, w.dst_pages))
        rule = self.faults.match("post", w.req_id)
        if rule is not None and rule.action == "fail":
            self._emit(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                     "injected failure at post"), rule)
            return
        if rule is not None and rule.action == "drop":
            return                    # never posted, never completes: the lease ends it
        if rule is not None and rule.action == "delay":
            self._held.append((time.monotonic() + rule.delay_s, w))
            return
        self._post(w)

    def check_layout(self, peer: Incarnation, layout) -> None:
        """ValueError naming both engines if `layout` (the peer's, None if
        it sent none) cannot map onto this engine's pages."""
        if self.layout is not None and layout is not None:
            self.layout.check_peer(self.incarnation.engine_id, layout, peer.engine_id)

    def in_flight(self, req_id: str) -> bool:
        """May a write of `req_id` still read this engine's source pages?
        True from `write` until the write's DONE, FAILED or CANCELLED (a
        write a delay fault holds back counts: it will be posted). P keeps
        the pages pinned while this holds, whatever its lease says."""
        return any(w.req_id == req_id for _, w in self._held) or \
            self._backend_in_flight(req_id)

    def cancel(self, req_id: str) -> None:
        """The sender let the request go: stop its writes where that is
        possible. A write a delay fault still holds back is never posted
        (a real post is synchronous; this keeps the fault honest); a posted
        one is stopped if the backend can (`_cancel_posted`). Each stopped
        write is reported CANCELLED at the next poll; the others run on and
        end as DONE or FAILED, and `in_flight` stays true until they do."""
        stopped = [w for _, w in self._held if w.req_id == req_id]
        self._held = [h for h in self._held if h[1].req_id != req_id]
        stopped += self._cancel_posted(req_id)
        for w in stopped:
            self._emit(TransferEvent(TransferEventKind.CANCELLED, w.req_id, w.epoch, w.target,
                                     "cancelled before it was read"))

    def poll(self) -> list[TransferEvent]:
        if self._held:
            now = time.monotonic()
            for _, w in [h for h in self._held if h[0] <= now]:
                self._post(w)
            self._held = [h for h in self._held if h[0] > now]
        out = []
        for ev in self._poll_backend():
            on_p = ev.kind is not TransferEventKind.LANDED
            stage = "completion" if on_p else "notification"
            done = ev.kind is TransferEventKind.DONE
            actions = ("fail", "delay", "drop") if done else ("delay", "drop")
            rule = self.faults.match(stage, ev.req_id, actions)
            if rule is None:
                out.append(ev)
            elif rule.action == "fail" and done:
                out.append(TransferEvent(TransferEventKind.FAILED, ev.req_id, ev.epoch, ev.peer,
                                         "injected failure at completion"))
            elif rule.action == "delay":
                self._delayed.append((time.monotonic() + rule.delay_s, ev))
            # "drop": swallowed, as if it never came
        now = time.monotonic()
        due = [ev for t, ev in self._delayed if t <= now]
        self._delayed = [(t, ev) for t, ev in self._delayed if t > now]
        out += due
        for ev in out:
            if ev.kind is TransferEventKind.FAILED:
                self.metrics.failures += 1
            elif ev.kind is TransferEventKind.LANDED:
                self.metrics.landed += 1
        return out

    def _emit(self, ev: TransferEvent, rule=None) -> None:
        """Report an event at the next poll."""
        self._delayed.append((0.0, ev))

    def close(self) -> None:
        """Release what the backend holds."""
