"""The NIXL transport: one agent per engine incarnation over UCX.

The KV pools (page-major, so page i is one contiguous region; one per cache
group) are registered once, and one descriptor per page, the groups' pages
numbered one after another, is prepared once locally and once per peer
incarnation; a write names page indices on both sides and NIXL merges
consecutive ones into single descriptors. So a transfer costs no
registration and no descriptor building: only `make_prepped_xfer` and
`transfer`. Completion is polled (`check_xfer_state`) off the critical
path; D learns of a landing from the write's notification.
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np

from pdserve.transfer.kv_layout import KvLayout
from pdserve.transfer.nixl.agent import PROGRESS_WAKE_US, new_agent
from pdserve.transfer.notification import KvNote
from pdserve.transfer.transport import (
    Incarnation, KvTransport, KvWrite, TransferEvent, TransferEventKind)


class NixlTransport(KvTransport):
    def __init__(self, incarnation: Incarnation, faults=None, backends=("UCX",),
                 telemetry: bool = False, progress_wake_us: int | None = PROGRESS_WAKE_US):
        """`telemetry`: have NIXL record each transfer and add the descriptor
        count it reports (after its merging) to metrics.backend_descriptors.
        `progress_wake_us`: UCX progresses transfers from a thread of its own
        that sleeps until the network wakes it (or this many microseconds),
        so a write moves while this engine computes a round. None: no
        thread; transfers move only when this side polls (`poll`, once per
        engine tick, so a large write waits out the rounds of both ends)."""
        super().__init__(incarnation, faults)
        self.telemetry = telemetry
        self.agent = new_agent(incarnation.agent_name, backends, telemetry, progress_wake_us)
        self._reg = None
        self._local = None
        self._descs = None
        self._peers: dict[str, tuple[Incarnation, str, object]] = {}   # id -> (inc, name, handle)
        self._peer_pages: dict[str, int] = {}                            # id -> its pool's pages
        self._inflight: dict = {}                                        # handle -> (write, t0)
        self.rank_writes = None     # RankWrites: per-rank transfer (transfer/tp/rank_writes.py)

    def use_ranks(self, ranks) -> None:
        """Move KV per rank (every rank of this engine its agent, `ranks`;
        transfer/tp/rank_writes.py) with every peer whose metadata carries its
        ranks, instead of this agent's whole pages. After register_pools."""
        from pdserve.transfer.tp.rank_writes import RankWrites

        if self.layout is None:
            raise ValueError("per-rank transfer needs the engine's KvLayout: register_pools first")
        self.rank_writes = RankWrites(ranks, self.layout)

    def _register(self, pools: list) -> None:
        for pool in pools:
            if not pool.is_contiguous():
                raise ValueError("each KV pool must be one contiguous page-major tensor")
        self.pool = pools[0]
        self._reg = [self.agent.register_memory(pool) for pool in pools]  # type: ignore[assignment]
        rows = []
        for pool, size in zip(pools, self.group_page_bytes):
            dev = max(pool.get_device(), 0)
            base = pool.data_ptr()
            rows += [[base + i * size, size, dev] for i in range(pool.shape[0])]
        mem = "VRAM" if pools[0].is_cuda else "DRAM"
        self._descs = self.agent.get_xfer_descs(np.array(rows, dtype=np.uint64), mem)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._descs)

    def metadata(self) -> bytes:
        return json.dumps({
            "agent": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "descs": base64.b64encode(self.agent.get_serialized_descs(self._descs)).decode(),
            "page_bytes": self.group_page_bytes, "pages": self.num_pages,
            "incarnation": self.incarnation.agent_name,
            "layout": None if self.layout is None else self.layout.as_json(),
            "ranks": None if self.rank_writes is None
            else [m.as_json() for m in self.rank_writes.metas],
        }).encode()

    def add_peer(self, incarnation: Incarnation, metadata: bytes) -> None:
        md = json.loads(metadata)
        if not isinstance(md, dict) or not isinstance(md.get("pages"), int) or md["pages"] < 1:
            raise ValueError(f"metadata for {incarnation.agent_name} names no page count")
        if md["incarnation"] != incarnation.agent_name:
            raise ValueError(f"metadata is for {md['incarnation']}, not {incarnation.agent_name}")
        if md.get("layout") is not None:
            self.check_layout(incarnation, KvLayout.from_json(md["layout"]))
        per_rank = self.rank_writes is not None and md.get("ranks") is not None
        if self.rank_writes is not None and not per_rank:
            raise ValueError(f"{incarnation.agent_name} moves KV whole pages through one agent, "
                             f"{self.incarnation.agent_name} per rank: serve both from one "
                             "deployment (any tensor-parallel prefill or decode role moves every "
                             "engine's KV per rank)")
        if not per_rank and md["page_bytes"] != self.group_page_bytes:
            raise ValueError(f"{incarnation.agent_name} has pages of {md['page_bytes']} bytes per "
                             f"cache group, this engine {self.group_page_bytes}: give both the "
                             "same model, dtype and page_size")
        old = self._peers.get(incarnation.engine_id)
        if old is not None:
            if old[0].epoch >= incarnation.epoch:
                return                                 # the same, or a stale late message
            self.remove_peer(incarnation.engine_id)    # a restart: drop what we knew
        agent, descs = base64.b64decode(md["agent"]), base64.b64decode(md["descs"])
        name = self.agent.add_remote_agent(agent)
        name = name.decode() if isinstance(name, bytes) else name
        try:
            remote = self.agent.deserialize_descs(descs)
            handle = self.agent.prep_xfer_dlist(name, remote)
        except Exception as e:                    # nothing of a refused peer is kept
            self.agent.remove_remote_agent(name)
            raise ValueError(f"{incarnation.agent_name}'s descriptors: {e}") from None
        self._peers[incarnation.engine_id] = (incarnation, name, handle)
        self._peer_pages[incarnation.engine_id] = md["pages"]
        if per_rank:
            from pdserve.transfer.tp.rank_agent import KvRankMeta

            assert self.rank_writes is not None
            self.rank_writes.add_peer(incarnation, KvLayout.from_json(md["layout"]),
                                      [KvRankMeta.from_json(m) for m in md["ranks"]])

    def peer_pages(self, engine_id: str) -> int | None:
        return self._peer_pages.get(engine_id)

    def remove_peer(self, engine_id: str) -> None:
        entry = self._peers.pop(engine_id, None)
        self._peer_pages.pop(engine_id, None)
        if entry is None:
            return
        inc, name, handle = entry
        if self.rank_writes is not None:
            self.rank_writes.remove_peer(engine_id)
        self.agent.release_dlist_handle(handle)
        self.agent.remove_remote_agent(name)

    def peers(self) -> list[Incarnation]:
        return sorted(e[0] for e in self._peers.values())

    def _post(self, w: KvWrite) -> None:
        entry = self._peers.get(w.target.engine_id)
        if self.rank_writes is not None and entry is not None:
            failed = self.rank_writes.post(w, self._per_group(w.src_pages))
            if failed is not None:
                self._emit(failed)
            return
        if entry is None or entry[0] != w.target:
            self._emit(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                     f"{w.target.agent_name} is not a known peer incarnation"))
            return
        try:
            t0 = time.perf_counter()
            handle = self.agent.make_prepped_xfer(
                "WRITE", self._local, np.asarray(w.src_pages, dtype=np.int64), entry[2],
                np.asarray(w.dst_pages, dtype=np.int64), KvNote.of(w).encode())
            self.metrics.setup_seconds += time.perf_counter() - t0
        except Exception as e:            # the binding raises on a dead peer
            self._emit(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                     f"post: {e}"))
            return
        try:
            state = self.agent.transfer(handle)
        except Exception as e:
            self._release(handle)
            self._emit(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                     f"post: {e}"))
            return
        if state == "ERR":
            self._release(handle)
            self._emit(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                     "post: ERR"))
            return
        self._inflight[handle] = (w, time.perf_counter())

    def _per_group(self, page_ids) -> list:
        """This engine's transport page ids as per-group page lists."""
        out: list[list[int]] = [[] for _ in self.offsets]
        for pid in page_ids:
            g, p = self.locate(pid)
            out[g].append(p)
        return out

    def _poll_backend(self) -> list[TransferEvent]:
        out = []
        if self.rank_writes is not None:
            out += self.rank_writes.poll(self.incarnation)
            self.metrics.dropped_notifications += self.rank_writes.dropped
            self.rank_writes.dropped = 0
        for handle, (w, t0) in list(self._inflight.items()):
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception as e:
                state, err = "ERR", str(e)
            else:
                err = "transfer error"
            if state == "PROC":
                continue
            del self._inflight[handle]
            took = time.perf_counter() - t0
            self.metrics.seconds += took
            if self.telemetry and state == "DONE":
                tm = self.agent.get_xfer_telemetry(handle)
                self.metrics.backend_descriptors += tm.descCount
            self._release(handle)
            if state == "DONE":
                out.append(TransferEvent(TransferEventKind.DONE, w.req_id, w.epoch, w.target,
                                         seconds=took))
            else:
                out.append(TransferEvent(TransferEventKind.FAILED, w.req_id, w.epoch, w.target,
                                         err))
        for agent_name, msgs in self.agent.get_new_notifs().items():
            for msg in msgs:
                note = KvNote.decode(msg)
                sender = Incarnation.parse(agent_name)
                if note is None or note.target != self.incarnation or \
                        note.source not in (None, sender):
                    self.metrics.dropped_notifications += 1   # meant for another incarnation
                    continue
                out.append(TransferEvent(TransferEventKind.LANDED, note.req_id, note.epoch,
                                         sender,
                                         first_token=note.first_token, payload=note.payload,
                                         drafts=note.drafts))
        return out

    def _backend_in_flight(self, req_id: str) -> bool:
        return any(w.req_id == req_id for w, _ in self._inflight.values()) or \
            (self.rank_writes is not None and self.rank_writes.in_flight(req_id))

    # No `_cancel_posted`: a posted write is left to end as DONE or ERR.
    # NIXL's release_xfer_handle on an active transfer "attempts to cancel"
    # it, and its UCX backend cancels the UCX requests and reports success
    # while noting that this may not be enough: a success is no proof the
    # NIC stopped reading P's pages. Waiting for the transfer's own end is
    # (UCX fails a transfer to a dead peer on its own).

    def _release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as e:            # nixl keeps what it cannot cancel; say so
            import logging

            logging.getLogger("pdserve.transfer").warning("release_xfer_handle: %s", e)

    def close(self) -> None:
        for handle in list(self._inflight):
            self._release(handle)
        self._inflight.clear()
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        if self.rank_writes is not None:
            self.rank_writes.close()
            self.rank_writes = None
        if self._local is not None:
            self.agent.release_dlist_handle(self._local)
            self._local = None
        if self._reg is not None:
            for reg in self._reg:
                self.agent.deregister_memory(reg)
            self._reg = None
