"""An in-process transport with the NIXL transport's contract, for tests:
a write copies the pages at once and reports completion and notification
at the next poll of each side.

`hold_writes = True` makes posted writes stay posted, not complete, until
`complete_held()`: the copy (the read of P's source pages) happens then,
so a test can free or reuse the source meanwhile and see what D would get.
A held write has read nothing yet, so `cancel` stops it (CANCELLED);
with `can_cancel = False` it runs on to its end, as a posted NIXL write
does (nixl_transport.py says why)."""

from __future__ import annotations

import time

from pdserve.transfer.transport import (
    Incarnation, KvTransport, KvWrite, TransferEvent, TransferEventKind)


class LoopbackFabric:
    """Where in-process transports find each other (an address space)."""

    def __init__(self):
        self.endpoints: dict[str, "LoopbackTransport"] = {}   # engine id -> live transport


class LoopbackTransport(KvTransport):
    def __init__(self, incarnation: Incarnation, fabric: LoopbackFabric, faults=None):
        super().__init__(incarnation, faults)
        self.fabric = fabric
        self.pool = None
        self._peers: dict[str, Incarnation] = {}
        self._events: list[TransferEvent] = []
        self.hold_writes = False
        self.can_cancel = True
        self._posted: list[KvWrite] = []      # held: posted, not complete
        fabric.endpoints[incarnation.engine_id] = self

    def _register(self, pools: list) -> None:
        self.pools = pools
        self.pool = pools[0]

    def metadata(self) -> bytes:
        return self.incarnation.agent_name.encode()

    def add_peer(self, incarnation: Incarnation, metadata: bytes) -> None:
        if metadata.decode() != incarnation.agent_name:
            raise ValueError(f"metadata names {metadata.decode()}, not {incarnation.agent_name}")
        live = self.fabric.endpoints.get(incarnation.engine_id)
        if live is not None and live.incarnation == incarnation:
            self.check_layout(incarnation, live.layout)   # what NIXL's metadata carries
        old = self._peers.get(incarnation.engine_id)
        if old is None or old.epoch < incarnation.epoch:     # never go back to a stale one
            self._peers[incarnation.engine_id] = incarnation

    def remove_peer(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)

    def peer_pages(self, engine_id: str) -> int | None:
        live = self.fabric.endpoints.get(engine_id)
        return live.num_pages if engine_id in self._peers and live is not None else None

    def peers(self) -> list[Incarnation]:
        return sorted(self._peers.values())

    def _post(self, w: KvWrite) -> None:
        known = self._peers.get(w.target.engine_id)
        live = self.fabric.endpoints.get(w.target.engine_id)
        if known != w.target or live is None or live.incarnation != w.target:
            self._emit(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                     f"{w.target.agent_name} is not a live peer"))
            return
        if self.hold_writes:
            self._posted.append(w)
            return
        self._complete(w, live)

    def held(self) -> list[KvWrite]:
        """The writes posted and held (`hold_writes`), oldest first."""
        return list(self._posted)

    def complete_held(self, req_id: str | None = None) -> int:
        """Let held writes (of `req_id`, or all) complete now: they read the
        source pages as they are at this moment. Returns how many did."""
        done = [w for w in self._posted if req_id is None or w.req_id == req_id]
        self._posted = [w for w in self._posted if w not in done]
        for w in done:
            live = self.fabric.endpoints.get(w.target.engine_id)
            if live is None or live.incarnation != w.target:
                self._emit(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                         f"{w.target.agent_name} went away mid-write"))
            else:
                self._complete(w, live)
        return len(done)

    def _backend_in_flight(self, req_id: str) -> bool:
        return any(w.req_id == req_id for w in self._posted)

    def _cancel_posted(self, req_id: str) -> list[KvWrite]:
        if not self.can_cancel:
            return []
        stopped = [w for w in self._posted if w.req_id == req_id]
        self._posted = [w for w in self._posted if w.req_id != req_id]
        return stopped

    def _complete(self, w: KvWrite, live: "LoopbackTransport") -> None:
        t0 = time.perf_counter()
        for s, d in zip(w.src_pages, w.dst_pages):
            gs, ps = self.locate(s)
            gd, pd = live.locate(d)
            if gs != gd:
                raise ValueError(f"{w.req_id}: page {s} of group {gs} written to group {gd}")
            live.pools[gd][pd] = self.pools[gs][ps]
        took = time.perf_counter() - t0
        self.metrics.seconds += took
        self._events.append(TransferEvent(TransferEventKind.DONE, w.req_id, w.epoch, w.target,
                                          seconds=took))
        live._events.append(TransferEvent(TransferEventKind.LANDED, w.req_id, w.epoch,
                                          self.incarnation, first_token=w.first_token,
                                          payload=w.payload, drafts=w.drafts))

    def _poll_backend(self) -> list[TransferEvent]:
        out, self._events = self._events, []
        return out

    def close(self) -> None:
        if self.fabric.endpoints.get(self.incarnation.engine_id) is self:
            del self.fabric.endpoints[self.incarnation.engine_id]
