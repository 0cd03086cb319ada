"""One rank's NIXL agent for per-rank KV transfer between tensor-parallel
engines (transfer/tp/pieces.py says who sends what, and how a piece
crosses: one block a page).

Each rank, rank 0 or a worker, owns an agent with its own KV shard
registered (one page-major pool per cache group). `meta()` is what a peer
needs of it (`KvRankMeta`: the agent's NIXL metadata and the pools'
addresses); an engine's ranks' metas travel together in its transport
metadata.

P's side: `connect` prepares, once per peer incarnation, for every piece
this rank sends, a local and a remote descriptor list of one row a page
(the local one over a registered send buffer of one slot a page when the
piece is packed), so a write names row indices only. `post` packs what must
be packed and starts one NIXL write per piece, each with its own
notification (a `PieceNote`: the piece's P and D ranks, the destination
pages, the write's own note); `poll` reports the ends
of this rank's writes (`PieceEnd`).

D's side: `accept` learns which pieces a P engine owes this rank; `poll`
collects their notifications and, once every piece of one write reached
this rank, unpacks its packed pages in place and reports the write once
(`RankLanded`)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from pdserve.transfer.kv_layout import KvLayout
from pdserve.transfer.nixl.agent import PROGRESS_WAKE_US, new_agent
from pdserve.transfer.notification import PieceNote
from pdserve.transfer.tp.pieces import KvPiece, piece_wire, plan_pieces


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
    """P: one of this rank's piece writes ended (ok, or failed: `reason`)."""
    tag: str
    piece: KvPiece
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class RankLanded:
    """D: every piece of one write owed to this rank landed (and its packed
    pages are unpacked); `notif`: the write's own notification."""
    peer: str
    notif: bytes
    dst: tuple                  # the destination pages, per cache group


@dataclass(frozen=True)
class RankPolled:
    """One rank's news at a poll: its pieces' ends, the writes whose every
    piece reached it, foreign notifications dropped."""
    rank: int
    ends: tuple                 # PieceEnd
    landed: tuple               # RankLanded
    dropped: int


@dataclass
class _Route:
    """A piece this rank sends to one peer: its prepared lists, and per
    cache group its wire, first rows and send buffer (packed pieces)."""
    piece: KvPiece
    local: object               # prepared local dlist (the shard, or the send buffers)
    far: object                 # prepared remote dlist (D's shard)
    local_starts: list          # per group: its first row (one row a page)
    far_starts: list
    wires: list                 # per group: PieceWire
    send: list                  # per group: the send buffer if packed, else None


@dataclass
class _Owed:
    """D: what one P engine's writes bring this rank."""
    agents: set                 # the P ranks' agent names
    pieces: list                # the pieces to this rank
    wires: list                 # per piece, per group: PieceWire


class KvRankAgent:
    def __init__(self, name: str, rank: int, pools: list, layout: KvLayout,
                 progress_wake_us: int | None = None):
        for pool in pools:
            if not pool.is_contiguous():
                raise ValueError("each KV shard must be one contiguous page-major tensor")
        self.name, self.rank, self.layout = name, rank, layout
        self.pools = pools
        self.itemsize = pools[0].element_size()
        self.agent = new_agent(name, ("UCX",), False,
                               progress_wake_us if progress_wake_us is not None
                               else PROGRESS_WAKE_US)
        self._reg = [self.agent.register_memory(p) for p in pools]
        self._routes: dict[str, list[_Route]] = {}      # peer -> this rank's pieces to it
        self._remote: dict[str, set] = {}               # peer -> D agents added for it
        self._send_regs: dict[str, list] = {}           # peer -> its send buffers' registrations
        self._inflight: dict = {}                       # handle -> (tag, piece)
        self._owed: dict[str, _Owed] = {}               # D: peer -> what it sends this rank
        self._broken: dict[str, tuple] = {}             # P: peer -> (its pieces, why no route)
        self._arrived: dict = {}                        # D: (peer, notif) -> pieces landed
        self.failed_at_post: list[PieceEnd] = []        # reported at the next poll (tp_kv_ranks)
        self.descriptors = 0                            # rows named by posted writes
        self.packed_bytes = 0                           # P: packed into send slots
        self.unpacked_bytes = 0                         # D: rearranged in place

    def meta(self) -> KvRankMeta:
        p = self.pools[0]
        return KvRankMeta(self.rank, self.agent.get_agent_metadata(), self.name,
                          tuple(x.data_ptr() for x in self.pools),
                          tuple(x.shape[0] for x in self.pools),
                          tuple(x[0].numel() * x.element_size() for x in self.pools),
                          "VRAM" if p.is_cuda else "DRAM", max(p.get_device(), 0))

    # ---- P ---------------------------------------------------------------------------------
    def connect(self, peer: str, d_layout: KvLayout, d_ranks: list[KvRankMeta]) -> int:
        """Prepare this rank's pieces to the D engine `peer` (its layout and
        every rank's meta); returns how many this rank sends. Once per peer:
        `forget` it first for a new incarnation. A peer that cannot be
        reached (its agent gone) is not raised: every write to it fails its
        pieces at the post (`post`), as a write to a dead peer fails."""
        if peer in self._routes or peer in self._broken:
            return len(self._routes.get(peer, ())) or len(self._broken[peer][0])
        try:
            return self._connect(peer, d_layout, d_ranks)
        except Exception as e:
            mine = [x for x in plan_pieces(self.layout, d_layout) if x.p_rank == self.rank]
            self._broken[peer] = (mine, f"connect: {e}")
            return len(mine)

    def _connect(self, peer: str, d_layout: KvLayout, d_ranks: list[KvRankMeta]) -> int:
        routes: list[_Route] = []
        added: set = set()
        regs: list = []
        try:
            for piece in plan_pieces(self.layout, d_layout):
                if piece.p_rank != self.rank:
                    continue
                far = d_ranks[piece.d_rank]
                if far.name not in added:
                    got = self.agent.add_remote_agent(far.agent)
                    added.add(got.decode() if isinstance(got, bytes) else got)
                wires = [piece_wire(piece, self.layout, d_layout, g, self.itemsize)
                         for g in range(len(self.pools))]
                send = [self._send_buffer(pool, piece) if w.p_packed else None
                        for pool, w in zip(self.pools, wires)]
                regs += [self.agent.register_memory(b) for b in send if b is not None]
                local_rows: list[np.ndarray] = []
                far_rows: list[np.ndarray] = []
                local_starts: list[int] = []
                far_starts: list[int] = []
                for g, (pool, w, buf) in enumerate(zip(self.pools, wires, send)):
                    src = pool if buf is None else buf
                    local_starts.append(sum(r.shape[0] for r in local_rows))
                    local_rows.append(_page_rows(src.data_ptr(), src.shape[0],
                                                 src[0].numel() * src.element_size(), 0,
                                                 w.length, max(src.get_device(), 0)))
                    far_starts.append(sum(r.shape[0] for r in far_rows))
                    far_rows.append(_page_rows(far.bases[g], far.pages[g], far.page_bytes[g],
                                               w.d_offset, w.length, far.device))
                mem = "VRAM" if self.pools[0].is_cuda else "DRAM"
                local = self.agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", self.agent.get_xfer_descs(np.concatenate(local_rows), mem))
                remote = self.agent.prep_xfer_dlist(
                    far.name, self.agent.get_xfer_descs(np.concatenate(far_rows), far.mem))
                routes.append(_Route(piece, local, remote, local_starts, far_starts, wires, send))
        except Exception:
            for r in routes:
                self.agent.release_dlist_handle(r.local)
                self.agent.release_dlist_handle(r.far)
            for reg in regs:
                self.agent.deregister_memory(reg)
            for name in added:
                self.agent.remove_remote_agent(name)
            raise
        self._routes[peer] = routes
        self._remote[peer] = added
        self._send_regs[peer] = regs
        return len(routes)

    def _send_buffer(self, pool, piece: KvPiece):
        """One slot a page of `pool` for `piece`'s heads:
        [pages, layers, 2, page_size, count, head_dim]."""
        import torch

        shape = tuple(pool.shape[:-2]) + (piece.count, pool.shape[-1])
        return torch.empty(shape, dtype=pool.dtype, device=pool.device)

    def forget(self, peer: str) -> None:
        for r in self._routes.pop(peer, []):
            self.agent.release_dlist_handle(r.local)
            self.agent.release_dlist_handle(r.far)
        for reg in self._send_regs.pop(peer, []):
            self.agent.deregister_memory(reg)
        for name in self._remote.pop(peer, set()):
            try:
                self.agent.remove_remote_agent(name)
            except Exception:           # already unreachable: nothing more to let go
                pass
        self._owed.pop(peer, None)
        self._broken.pop(peer, None)
        self._arrived = {k: v for k, v in self._arrived.items() if k[0] != peer}

    def post(self, peer: str, tag: str, src: list, dst: list, notif: bytes) -> list[PieceEnd]:
        """Start this rank's pieces of a write of pages `src` (per cache
        group) into D's `dst` (per cache group), packing first what must be;
        returns the pieces that failed at once (the others end at a later
        `poll`)."""
        import torch

        if peer in self._broken:
            pieces, why = self._broken[peer]
            return [PieceEnd(tag, x, False, why) for x in pieces]
        failed = []
        for r in self._routes.get(peer, []):
            for pool, buf, pages in zip(self.pools, r.send, src):
                if buf is not None and len(pages):
                    idx = torch.as_tensor(pages, dtype=torch.int64, device=pool.device)
                    a = r.piece.p_first
                    buf.index_copy_(0, idx, pool.index_select(0, idx)[..., a:a + r.piece.count, :])
                    self.packed_bytes += buf[0].nbytes * len(pages)
            li = _indices(r.local_starts, src)
            ri = _indices(r.far_starts, dst)
            note = PieceNote(r.piece.p_rank, r.piece.d_rank,
                             tuple(tuple(int(x) for x in g) for g in dst), notif)
            try:
                handle = self.agent.make_prepped_xfer("WRITE", r.local, li, r.far, ri,
                                                      note.encode())
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

    # ---- D ---------------------------------------------------------------------------------
    def accept(self, peer: str, p_layout: KvLayout, p_ranks: list[KvRankMeta]) -> int:
        """Learn what the P engine `peer` writes to this rank; returns how
        many pieces each of its writes brings here."""
        pieces = [x for x in plan_pieces(p_layout, self.layout) if x.d_rank == self.rank]
        wires = [[piece_wire(x, p_layout, self.layout, g, self.itemsize)
                  for g in range(len(self.pools))] for x in pieces]
        self._owed[peer] = _Owed({m.name for m in p_ranks}, pieces, wires)
        return len(pieces)

    def _landed(self, sender: str, msg: bytes) -> RankLanded | None:
        note = PieceNote.decode(msg)
        peer = next((p for p, o in self._owed.items() if sender in o.agents), None)
        if note is None or peer is None:
            return None
        p_rank, d_rank, dst, inner = note.p_rank, note.d_rank, note.pages, note.note
        owed = self._owed[peer]
        key = (peer, inner)
        got = self._arrived.setdefault(key, set())
        got.add(p_rank)
        if len(got) < len(owed.pieces):
            return None
        del self._arrived[key]
        self._unpack(owed, dst)
        return RankLanded(peer, inner, dst)

    def _unpack(self, owed: _Owed, dst) -> None:
        """Rearrange, in place, each destination page whose heads landed as
        blocks side by side (`PieceWire.d_packed`) into the token-major page."""
        import torch

        for g, (pool, pages) in enumerate(zip(self.pools, dst)):
            packed = [(x, w[g]) for x, w in zip(owed.pieces, owed.wires) if w[g].d_packed]
            if not packed or not len(pages):
                continue
            idx = torch.as_tensor(pages, dtype=torch.int64, device=pool.device)
            landed = pool.index_select(0, idx)              # the blocks as they landed
            flat = landed.view(len(pages), -1)
            pages_out = torch.empty_like(landed)
            blocks = tuple(pool.shape[1:-2])
            for x, w in packed:
                first = w.d_offset // self.itemsize
                n = w.length // self.itemsize
                shape = (len(pages),) + blocks + (x.count, pool.shape[-1])
                pages_out[..., x.d_first:x.d_first + x.count, :] = \
                    flat[:, first:first + n].view(shape)
            pool.index_copy_(0, idx, pages_out)
            self.unpacked_bytes += landed.nbytes

    # ---- both ------------------------------------------------------------------------------
    def poll(self) -> tuple[list[PieceEnd], list[RankLanded], int]:
        """(the ends of this rank's writes, the writes whose every piece
        reached this rank, how many foreign notifications were dropped)."""
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
        landed, dropped = [], 0
        for sender, msgs in self.agent.get_new_notifs().items():
            name = sender.decode() if isinstance(sender, bytes) else sender
            for m in msgs:
                if PieceNote.decode(m) is None or name not in {a for o in self._owed.values()
                                                  for a in o.agents}:
                    dropped += 1
                    continue
                done = self._landed(name, m)
                if done is not None:
                    landed.append(done)
        return ended, landed, dropped

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


def _page_rows(base: int, pages: int, page_bytes: int, offset: int, length: int,
               device: int) -> np.ndarray:
    """One [addr, len, dev] row a page: `length` bytes at `offset` in each."""
    addr = np.uint64(base + offset) + np.arange(pages, dtype=np.uint64) * np.uint64(page_bytes)
    return np.stack([addr, np.full(pages, length, dtype=np.uint64),
                     np.full(pages, device, dtype=np.uint64)], axis=1)


def _indices(starts: list, pages: list) -> np.ndarray:
    """Row indices of `pages` (per group) in a list of one row a page laid out by `starts`."""
    out = [first + np.asarray(ps, dtype=np.int64) for first, ps in zip(starts, pages) if len(ps)]
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


class LocalRanks:
    """A size-1 engine's one rank, behind the interface a tensor-parallel
    engine's rank 0 offers for all its ranks (engine/tp/kv_ranks.TpKvRanks)."""

    def __init__(self, name: str, pools: list, layout: KvLayout):
        self.agent = KvRankAgent(f"{name}#0", 0, pools, layout)
        self.metas = (self.agent.meta(),)

    def connect(self, peer: str, layout: KvLayout, metas) -> None:
        self.agent.connect(peer, layout, list(metas))

    def accept(self, peer: str, layout: KvLayout, metas) -> None:
        self.agent.accept(peer, layout, list(metas))

    def post(self, peer: str, tag: str, src, dst, notif: bytes) -> None:
        self.agent.failed_at_post += self.agent.post(peer, tag, list(src), list(dst), notif)

    def forget(self, peer: str) -> None:
        self.agent.forget(peer)

    def poll(self) -> list[RankPolled]:
        ends, landed, dropped = self.agent.poll()
        ends = self.agent.failed_at_post + ends
        self.agent.failed_at_post = []
        return [RankPolled(0, tuple(ends), tuple(landed), dropped)]

    def close(self) -> None:
        self.agent.close()

