"""An engine's per-rank writes and landings (the transport's side of
per-rank KV transfer): what turns every rank's piece ends and landings into
the one DONE, FAILED or LANDED event per write a transport reports.

`ranks` is the engine's handle on every rank's agent (a size-1 engine's
`rank_agent.LocalRanks`, a tensor-parallel engine's `tp_kv_ranks.TpKvRanks`:
metas, connect, accept, post, forget, poll). P: a write is posted on every
rank (each rank its pieces); it is DONE when every piece on every P rank
ended well, FAILED once every piece ended and one did not, and in flight
until every piece ended, so P's pin holds until then (and until D's ack, as
ever). D: a write LANDED when every D rank reported it (each rank once all
its pieces landed and were unpacked)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pdserve.transfer.kv_layout import KvLayout
from pdserve.transfer.notification import KvNote
from pdserve.transfer.tp.pieces import plan_pieces
from pdserve.transfer.transport import (
    Incarnation, KvWrite, TransferEvent, TransferEventKind)


@dataclass
class _Pending:
    write: KvWrite
    left: int                   # pieces not ended yet, over every P rank
    t0: float
    failed: list = field(default_factory=list)


@dataclass
class _Peer:
    incarnation: Incarnation
    layout: KvLayout
    metas: tuple
    connected: bool = False


class RankWrites:
    def __init__(self, ranks, layout: KvLayout):
        self.ranks, self.layout = ranks, layout
        self._peers: dict[str, _Peer] = {}
        self._pending: dict[str, _Pending] = {}
        self._tally: dict = {}                  # (peer, notif) -> D ranks that reported it
        self._tags = itertools.count()
        self.dropped = 0

    @property
    def metas(self) -> tuple:
        return tuple(self.ranks.metas)

    def add_peer(self, incarnation: Incarnation, layout: KvLayout, metas) -> None:
        """Know the peer's ranks; what it may write here is learnt now (D),
        what this engine writes there is prepared at the first write (P)."""
        self.ranks.accept(incarnation.engine_id, layout, list(metas))
        self._peers[incarnation.engine_id] = _Peer(incarnation, layout, tuple(metas))

    def remove_peer(self, engine_id: str) -> None:
        if self._peers.pop(engine_id, None) is not None:
            self.ranks.forget(engine_id)
        self._tally = {k: v for k, v in self._tally.items() if k[0] != engine_id}

    def post(self, w: KvWrite, src: list) -> TransferEvent | None:
        """Post `w` (`src`: its source pages per cache group) on every
        rank; a FAILED event if the peer is not known at this incarnation."""
        peer = self._peers.get(w.target.engine_id)
        if peer is None or peer.incarnation != w.target:
            return TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                 f"{w.target.agent_name} is not a known peer incarnation")
        if not peer.connected:
            self.ranks.connect(w.target.engine_id, peer.layout, list(peer.metas))
            peer.connected = True
        dst: list[list[int]] = [[] for _ in peer.metas[0].pages]
        firsts = [sum(peer.metas[0].pages[:g]) for g in range(len(dst))]
        for pid in w.dst_pages:             # the peer's transport ids: its groups one after another
            g = max(i for i, f in enumerate(firsts) if f <= pid)
            dst[g].append(pid - firsts[g])
        tag = f"{next(self._tags)}|{w.req_id}"
        self._pending[tag] = _Pending(w, len(plan_pieces(self.layout, peer.layout)),
                                      time.perf_counter())
        self.ranks.post(w.target.engine_id, tag, src, dst, KvNote.of(w).encode())
        return None

    def in_flight(self, req_id: str) -> bool:
        return any(p.write.req_id == req_id for p in self._pending.values())

    def poll(self, me: Incarnation) -> list[TransferEvent]:
        out: list[TransferEvent] = []
        if not self._pending and not self._peers:
            return out
        for polled in self.ranks.poll():
            self.dropped += polled.dropped
            for end in polled.ends:
                p = self._pending.get(end.tag)
                if p is None:
                    continue
                p.left -= 1
                if not end.ok:
                    p.failed.append(f"P rank {end.piece.p_rank} -> D rank "
                                    f"{end.piece.d_rank}: {end.reason}")
                if p.left == 0:
                    del self._pending[end.tag]
                    w, took = p.write, time.perf_counter() - p.t0
                    if p.failed:
                        out.append(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch,
                                                 w.target, "; ".join(p.failed)))
                    else:
                        out.append(TransferEvent(TransferEventKind.DONE, w.req_id, w.epoch,
                                                 w.target, seconds=took))
            for landed in polled.landed:
                out += self._landed(landed, me)
        return out

    def _landed(self, landed, me: Incarnation) -> list[TransferEvent]:
        peer = self._peers.get(landed.peer)
        note = KvNote.decode(landed.notif)
        if peer is None or note is None or note.target != me:
            self.dropped += 1                   # meant for another incarnation
            return []
        key = (landed.peer, landed.notif)
        got = self._tally.setdefault(key, 0) + 1
        if got < self.layout.tensor_parallel_size:
            self._tally[key] = got
            return []
        self._tally.pop(key, None)
        return [TransferEvent(TransferEventKind.LANDED, note.req_id, note.epoch,
                              note.source or peer.incarnation, first_token=note.first_token,
                              payload=note.payload, drafts=note.drafts)]

    def close(self) -> None:
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        self.ranks.close()
