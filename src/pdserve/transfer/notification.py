"""What a KV write tells D beside its pages, as typed messages: `KvNote`
(the request, the landing's epoch, the D incarnation it is for, the first
token, P's drafts, the first token's logprobs, the P incarnation that
wrote it) and, between
tensor-parallel ranks, `PieceNote` (one piece of such a write).

They travel as NIXL notifications, which carry bytes: each is a protobuf
message (proto/control.proto's KvNote, KvPieceNote) behind a short tag, so
an agent that receives something else (another program's notification, a
piece where a whole write is expected) reads None rather than a wrong
message."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from pdserve.proto import control_pb2 as pb
from pdserve.transfer.transport import Incarnation, KvWrite

NOTE_TAG = b"pdkv1:"
PIECE_TAG = b"pdkvp1:"


@dataclass(frozen=True)
class KvNote:
    req_id: str
    epoch: int                   # the landing's epoch on D
    target: Incarnation          # the D incarnation the pages belong to
    first_token: int
    drafts: tuple[int, ...] = ()
    payload: bytes = b""         # a TokenLogprob, serialized (engine/peer/protocol.py)
    source: Incarnation | None = None   # the P incarnation that wrote it (None: not said)

    @classmethod
    def of(cls, w: KvWrite) -> KvNote:
        return cls(w.req_id, w.epoch, w.target, w.first_token, tuple(w.drafts), w.payload,
                   w.source)

    def encode(self) -> bytes:
        return NOTE_TAG + pb.KvNote(
            request_id=self.req_id, epoch=self.epoch, target=self.target.agent_name,
            first_token=self.first_token, drafts=self.drafts, payload=self.payload,
            source=self.source.agent_name if self.source is not None else "").SerializeToString()

    @classmethod
    def decode(cls, msg: bytes) -> KvNote | None:
        """The note, or None for a message that is not one."""
        if not msg.startswith(NOTE_TAG):
            return None
        try:
            m = pb.KvNote.FromString(msg[len(NOTE_TAG):])
            return cls(m.request_id, m.epoch, Incarnation.parse(m.target), m.first_token,
                       tuple(m.drafts), m.payload,
                       Incarnation.parse(m.source) if m.source else None)
        except (DecodeError, ValueError):
            return None


@dataclass(frozen=True)
class PieceNote:
    p_rank: int
    d_rank: int
    pages: tuple[tuple[int, ...], ...]   # destination pages per cache group
    note: bytes                          # the write's KvNote, encoded, as P sent it

    def encode(self) -> bytes:
        return PIECE_TAG + pb.KvPieceNote(
            p_rank=self.p_rank, d_rank=self.d_rank,
            pages=[pb.PageIds(ids=[int(x) for x in g]) for g in self.pages],
            note=self.note).SerializeToString()

    @classmethod
    def decode(cls, msg: bytes) -> PieceNote | None:
        if not msg.startswith(PIECE_TAG):
            return None
        try:
            m = pb.KvPieceNote.FromString(msg[len(PIECE_TAG):])
        except DecodeError:
            return None
        return cls(m.p_rank, m.d_rank, tuple(tuple(g.ids) for g in m.pages), m.note)
