"""One rank's NIXL agent for per-rank KV transfer between tensor-parallel
engines (transfer/tp_pieces.py says who sends what).

Each rank, rank 0 or a worker, owns an agent with its own KV shard
registered (one page-major pool per cache group). `meta()` is what a peer
needs of it (`KvRankMeta`: the agent's NIXL metadata and the pools'
addresses); an engine's ranks' metas travel together in its transport
metadata. `connect` prepares, once per peer incarnation, for every piece
this rank sends, a local and a remote descriptor list with one row per
(page, run) of the piece (tp_pieces.piece_runs: a whole page, or a
(layer, K/V, token) run of the piece's heads), so a write names row indices
only. `post` starts one NIXL write per piece, each with its own
notification (`encode_piece_notif`), and `poll` reports the ends of this
rank's writes and the piece notifications that reached it."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from pdserve.transfer.kv_layout import KvLayout
from pdserve.transfer.tp_pieces import KvPiece, piece_runs, plan_pieces


@dataclass(frozen=True)
class KvRankMeta:
    """What a peer needs of one rank's agent."""
    rank: int
    agent: bytes                # nixl's agent metadata
    name: str                   # the agent's name
    bases: tuple                # each cache group's pool address
    pages: tuple                # each cache group's pages
    page_bytes: tuple           # each cache group's page (this rank's heads)
    mem: str                    # "DRAM" or "VRAM"
    device: int

    def as_json(self) -> dict:
        return {"rank": self.rank, "agent": base64.b64encode(self.agent).decode(),
                "name": self.name, "bases": list(self.bases), "pages": list(self.pages),
                "page_bytes": list(self.page_bytes), "mem": self.mem, "device": self.device}

    @classmethod
    def from_json(cls, d) -> "KvRankMeta":
        try:
            return cls(int(d["rank"]), base64.b64decode(d["agent"]), str(d["name"]),
                       tuple(int(x) for x in d["bases"]), tuple(int(x) for x in d["pages"]),
                       tuple(int(x) for x in d["page_bytes"]), str(d["mem"]), int(d["device"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a rank's transfer metadata lacks or garbles {e}: {d!r}") from None


@dataclass(frozen=True)
class PieceEnd:
    """One of this rank's piece writes ended (ok, or failed: `reason`)."""
    tag: str
    piece: KvPiece
    ok: bool
    reason: str = ""


@dataclass
class _Route:
    """A piece this rank sends to one peer: its prepared lists and row maps."""
    piece: KvPiece
    remote: str                 # the D rank's agent name
    local: object               # prepared local dlist
    far: object                 # prepared remote dlist
    local_rows: list            # per group: (first row, rows a page)
    far_rows: list


def encode_piece_notif(piece: KvPiece, notif: bytes) -> bytes:
    return f"pdkvp|{piece.p_rank}|{piece.d_rank}|".encode() + notif


def decode_piece_notif(msg: bytes) -> tuple[int, int, bytes] | None:
    """(P rank, D rank, the write's own notification), or None if foreign."""
    try:
        tag, p, d, rest = msg.split(b"|", 3)
        if tag != b"pdkvp":
            return None
        return int(p), int(d), rest
    except ValueError:
        return None


class KvRankAgent:
    def __init__(self, name: str, rank: int, pools: list, layout: KvLayout,
                 progress_wake_us: int | None = None):
        from pdserve.transfer.nixl_transport import PROGRESS_WAKE_US, _new_agent

        for pool in pools:
            if not pool.is_contiguous():
                raise ValueError("each KV shard must be one contiguous page-major tensor")
        self.name, self.rank, self.layout = name, rank, layout
        self.pools = pools
        self.itemsize = pools[0].element_size()
        self.agent = _new_agent(name, ("UCX",), False,
                                progress_wake_us if progress_wake_us is not None
                                else PROGRESS_WAKE_US)
        self._reg = [self.agent.register_memory(p) for p in pools]
        self._routes: dict[str, list[_Route]] = {}      # peer -> this rank's pieces to it
        self._remote: dict[str, set] = {}               # peer -> D agents added for it
        self._inflight: dict = {}                       # handle -> (tag, piece)
        self.descriptors = 0                            # rows named by posted writes

    def meta(self) -> KvRankMeta:
        p = self.pools[0]
        return KvRankMeta(self.rank, self.agent.get_agent_metadata(), self.name,
                          tuple(x.data_ptr() for x in self.pools),
                          tuple(x.shape[0] for x in self.pools),
                          tuple(x[0].numel() * x.element_size() for x in self.pools),
                          "VRAM" if p.is_cuda else "DRAM", max(p.get_device(), 0))

    def connect(self, peer: str, d_layout: KvLayout, d_ranks: list[KvRankMeta]) -> int:
        """Prepare this rank's pieces to the D engine `peer` (its layout and
        every rank's meta); returns how many this rank sends. Idempotent per
        peer: call `forget` first for a new incarnation."""
        if peer in self._routes:
            return len(self._routes[peer])
        mine = self.meta()
        routes: list[_Route] = []
        added: set = set()
        try:
            for piece in plan_pieces(self.layout, d_layout):
                if piece.p_rank != self.rank:
                    continue
                far = d_ranks[piece.d_rank]
                if far.name not in added:
                    got = self.agent.add_remote_agent(far.agent)
                    added.add(got.decode() if isinstance(got, bytes) else got)
                local_rows, lrows = _rows(mine, piece, self.layout, d_layout, self.itemsize, True)
                far_rows, frows = _rows(far, piece, self.layout, d_layout, self.itemsize, False)
                local = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", self.agent.get_xfer_descs(lrows, mine.mem))
                remote = self.agent.prep_xfer_dlist(
                    far.name, self.agent.get_xfer_descs(frows, far.mem))
                routes.append(_Route(piece, far.name, local, remote, local_rows, far_rows))
        except Exception:
            for r in routes:
                self.agent.release_dlist_handle(r.local)
                self.agent.release_dlist_handle(r.far)
            for name in added:
                self.agent.remove_remote_agent(name)
            raise
        self._routes[peer] = routes
        self._remote[peer] = added
        return len(routes)

    def forget(self, peer: str) -> None:
        for r in self._routes.pop(peer, []):
            self.agent.release_dlist_handle(r.local)
            self.agent.release_dlist_handle(r.far)
        for name in self._remote.pop(peer, set()):
            self.agent.remove_remote_agent(name)

    def post(self, peer: str, tag: str, src: list, dst: list, notif: bytes) -> list[PieceEnd]:
        """Start this rank's pieces of a write of pages `src` (per cache
        group) into D's `dst` (per cache group); returns the pieces that
        failed at once (the others end at a later `poll`)."""
        failed = []
        for r in self._routes.get(peer, []):
            li = _indices(r.local_rows, src)
            ri = _indices(r.far_rows, dst)
            try:
                handle = self.agent.make_prepped_xfer("WRITE", r.local, li, r.far, ri,
                                                      encode_piece_notif(r.piece, notif))
                state = self.agent.transfer(handle)
            except Exception as e:
                failed.append(PieceEnd(tag, r.piece, False, f"post: {e}"))
                continue
            if state == "ERR":
                self.agent.release_xfer_handle(handle)
                failed.append(PieceEnd(tag, r.piece, False, "post: ERR"))
                continue
            self.descriptors += len(li)
            self._inflight[handle] = (tag, r.piece)
        return failed

    def in_flight(self, tag: str) -> bool:
        return any(t == tag for t, _ in self._inflight.values())

    def poll(self) -> tuple[list[PieceEnd], list[bytes]]:
        """(the ends of this rank's writes, the piece notifications that reached it)."""
        ended = []
        for handle, (tag, piece) in list(self._inflight.items()):
            try:
                state = self.agent.check_xfer_state(handle)
                err = "transfer error"
            except Exception as e:
                state, err = "ERR", str(e)
            if state == "PROC":
                continue
            del self._inflight[handle]
            self.agent.release_xfer_handle(handle)
            ended.append(PieceEnd(tag, piece, state == "DONE", "" if state == "DONE" else err))
        notifs = [m for msgs in self.agent.get_new_notifs().values() for m in msgs]
        return ended, notifs

    def close(self) -> None:
        for handle in list(self._inflight):
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:
                pass
        self._inflight.clear()
        for peer in list(self._routes):
            self.forget(peer)
        for reg in self._reg:
            self.agent.deregister_memory(reg)
        self._reg = []


def _rows(meta: KvRankMeta, piece: KvPiece, p: KvLayout, d: KvLayout, itemsize: int,
          p_side: bool):
    """(per group (first row, rows a page), the [addr, len, dev] rows) of
    `piece` over every page of the rank `meta` describes."""
    rows: list[np.ndarray] = []
    starts: list[tuple[int, int]] = []
    for g, (base, pages, page_bytes) in enumerate(zip(meta.bases, meta.pages, meta.page_bytes)):
        runs = np.array(piece_runs(piece, p, d, g, itemsize)[0 if p_side else 1],
                        dtype=np.uint64)
        starts.append((sum(r.shape[0] for r in rows), len(runs)))
        page_base = base + np.arange(pages, dtype=np.uint64) * np.uint64(page_bytes)
        addr = (page_base[:, None] + runs[None, :, 0]).reshape(-1)
        length = np.broadcast_to(runs[None, :, 1], (pages, len(runs))).reshape(-1)
        rows.append(np.stack([addr, length, np.full_like(addr, meta.device)], axis=1))
    return starts, np.concatenate(rows).astype(np.uint64)


def _indices(starts: list, pages: list) -> np.ndarray:
    """Row indices of `pages` (per group) in a list laid out by `starts`."""
    out = []
    for (first, per), ps in zip(starts, pages):
        if len(ps):
            base = first + np.asarray(ps, dtype=np.int64) * per
            out.append((base[:, None] + np.arange(per, dtype=np.int64)[None, :]).reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
