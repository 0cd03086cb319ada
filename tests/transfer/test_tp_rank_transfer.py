"""Per-rank KV transfer between tensor-parallel engines, below the engine:
the pieces (which P rank sends which heads to which D rank), the bytes each
rank moves, and real NIXL writes between one agent per rank (ranks as
agents in this process: their shards are slices of one whole-page
reference) landing D's shards equal to the reference byte for byte, one
notification per piece at the D rank it wrote."""

import time

import pytest
import torch

from pdserve.transfer.kv_layout import KvLayout
from pdserve.transfer.notification import KvNote, PieceNote
from pdserve.transfer.transport import Incarnation
from pdserve.transfer.tp.rank_agent import KvRankAgent
from pdserve.transfer.tp.pieces import (
    KvPiece, PieceWire, bytes_per_rank, heads_of, piece_wire, plan_pieces)

LAYERS, PS, HD, KV = 2, 4, 16, 2


def _layout(tp: int, kv: int = KV) -> KvLayout:
    return KvLayout(tp, kv, HD, "float32", PS, (LAYERS,))


def test_heads_split_or_replicated():
    assert [heads_of(_layout(2), r) for r in range(2)] == [range(0, 1), range(1, 2)]
    assert [heads_of(_layout(4), r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert heads_of(_layout(1), 0) == range(0, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 is not a multiple of 2 KV"):
        heads_of(_layout(3), 0)


@pytest.mark.parametrize("p,d,want", [
    (1, 1, [KvPiece(0, 0, 0, 2, 0, 0)]),
    (1, 2, [KvPiece(0, 0, 0, 1, 0, 0), KvPiece(0, 1, 1, 1, 1, 0)]),
    (2, 1, [KvPiece(0, 0, 0, 1, 0, 0), KvPiece(1, 0, 1, 1, 0, 1)]),
    (2, 2, [KvPiece(0, 0, 0, 1, 0, 0), KvPiece(1, 1, 1, 1, 0, 0)]),
    # P's size above the KV heads: D's ranks read their head from different replicas
    (4, 2, [KvPiece(0, 0, 0, 1, 0, 0), KvPiece(3, 1, 1, 1, 0, 0)]),
    (4, 4, [KvPiece(0, 0, 0, 1, 0, 0), KvPiece(1, 1, 0, 1, 0, 0), KvPiece(2, 2, 1, 1, 0, 0),
            KvPiece(3, 3, 1, 1, 0, 0)]),
])
def test_pieces(p, d, want):
    assert plan_pieces(_layout(p), _layout(d)) == want


def test_a_piece_crosses_as_one_block_a_page_packed_where_the_page_holds_more_heads():
    plane = LAYERS * 2 * PS * HD * 4            # one head's block of a page
    assert piece_wire(KvPiece(0, 0, 0, 1, 0, 0), _layout(2), _layout(2), 0, 4) == \
        PieceWire(plane, False, False, 0)       # rank r to rank r: pages as they are
    # P TP 1 -> D TP 2: P packs head 1 of its pages; D's page is that head
    assert piece_wire(KvPiece(0, 1, 1, 1, 1, 0), _layout(1), _layout(2), 0, 4) == \
        PieceWire(plane, True, False, 0)
    # P TP 2 -> D TP 1: P's page is the head; it lands as D's page's second block
    assert piece_wire(KvPiece(1, 0, 1, 1, 0, 1), _layout(2), _layout(1), 0, 4) == \
        PieceWire(plane, False, True, plane)


def test_notes_round_trip_typed_and_a_foreign_message_is_none():
    """A write's KvNote and a piece's PieceNote come back as sent, a
    request id with any characters included; a message of another kind
    (the other note, text, a torn protobuf) reads as None."""
    note = KvNote("req|7:x", 3, Incarnation("decode-1", 12), 42, (5, 6), b"\x08\x01")
    assert KvNote.decode(note.encode()) == note
    piece = PieceNote(1, 0, ((3, 4), ()), note.encode())
    assert PieceNote.decode(piece.encode()) == piece
    assert KvNote.decode(PieceNote.decode(piece.encode()).note) == note
    for foreign in (piece.encode(), b"pdkv|1|2|3", note.encode()[:-3] + b"\xff\xff\xff", b""):
        assert KvNote.decode(foreign) is None
    assert PieceNote.decode(note.encode()) is None


@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2), (2, 4)])
def test_each_rank_moves_its_share_and_nothing_more(p, d):
    """n pages of B bytes (whole): each D rank receives its heads' share,
    B·n/d (B·n/KV when D replicates a head); P's ranks send exactly that,
    split evenly when P's heads are split (B·n/p each at D TP <= KV), its
    replicas sharing a head's bytes when not: every byte goes rank to rank."""
    n, whole = 10, LAYERS * 2 * PS * KV * HD * 4
    got = bytes_per_rank(_layout(p), _layout(d), [n], 4)
    assert got.received == (whole * n // min(d, KV),) * d
    assert sum(got.sent) == sum(got.received)
    if p <= KV:
        assert got.sent == (sum(got.received) // p,) * p
    else:
        assert max(got.sent) <= sum(got.received) // KV


def _shards(whole: torch.Tensor, layout: KvLayout) -> list[torch.Tensor]:
    return [whole[..., h.start:h.stop, :].contiguous()
            for h in (heads_of(layout, r) for r in range(layout.tensor_parallel_size))]


def _drain(p_agents, d_agents, pieces, bound_s=20.0):
    """Poll every agent until each P rank's pieces ended and each D rank
    reported the write landed; (ends, landings by D rank)."""
    ends, landed = [], {r: [] for r in range(len(d_agents))}
    deadline = time.monotonic() + bound_s
    while len(ends) < len(pieces) or any(not v for v in landed.values()):
        assert time.monotonic() < deadline, (ends, landed)
        for a in p_agents:
            ends += a.poll()[0]
        for r, a in enumerate(d_agents):
            got, mine, dropped = a.poll()
            assert got == [] and dropped == 0
            landed[r] += mine
    return ends, landed


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (2, 2)])
def test_nixl_rank_to_rank_lands_each_d_rank_its_heads_byte_for_byte(p, d):
    """One write: each D rank reports it once, when every piece it is owed
    landed, and then holds exactly the reference's heads of the written
    pages (unpacked in place where its page took blocks from several P
    ranks); nothing else on D changed; one descriptor a page a piece."""
    torch.manual_seed(p * 10 + d)
    pages = 12
    whole = torch.randn(pages, LAYERS, 2, PS, KV, HD)
    p_lay, d_lay = _layout(p), _layout(d)
    p_shards = _shards(whole, p_lay)
    d_shards = [torch.full_like(s, 7.0) for s in _shards(whole, d_lay)]
    p_agents = [KvRankAgent(f"prefill-0@1#{r}", r, [s], p_lay) for r, s in enumerate(p_shards)]
    d_agents = [KvRankAgent(f"decode-0@1#{r}", r, [s], d_lay) for r, s in enumerate(d_shards)]
    try:
        pieces = plan_pieces(p_lay, d_lay)
        p_metas = [a.meta() for a in p_agents]
        owed = [a.accept("prefill-0", p_lay, p_metas) for a in d_agents]
        assert owed == [sum(1 for x in pieces if x.d_rank == r) for r in range(d)]
        d_metas = [a.meta() for a in d_agents]
        assert sum(a.connect("decode-0", d_lay, d_metas) for a in p_agents) == len(pieces)
        src, dst = [1, 2, 3, 7], [8, 9, 10, 0]
        for a in p_agents:
            assert a.post("decode-0", "r1", [src], [dst], b"note") == []
        ends, landed = _drain(p_agents, d_agents, pieces)
        assert all(e.ok for e in ends) and sorted(e.piece for e in ends) == sorted(pieces)
        for r in range(d):
            assert [(x.peer, x.notif, x.dst) for x in landed[r]] == \
                [("prefill-0", b"note", (tuple(dst),))]
        for want, shard in zip(_shards(whole[src], d_lay), d_shards):
            assert torch.equal(shard[dst].view(torch.uint8), want.view(torch.uint8))
        untouched = [i for i in range(pages) if i not in dst]
        assert all(bool((s[untouched] == 7.0).all()) for s in d_shards)
        assert not any(a.in_flight("r1") for a in p_agents)
        assert sum(a.descriptors for a in p_agents) == len(src) * len(pieces)
        assert sum(a.packed_bytes for a in p_agents) == (whole[src].nbytes if p < d else 0)
        assert sum(a.unpacked_bytes for a in d_agents) == (whole[src].nbytes if p > d else 0)
    finally:
        for a in p_agents + d_agents:
            a.close()


def test_a_peer_that_cannot_be_reached_fails_its_pieces_at_the_post():
    """D's agent is gone (its metadata garbage here): connect does not
    raise, and each write fails every piece this rank owes at once, so
    nothing is left in flight and P's pages are let go as for any failed
    write."""
    from dataclasses import replace

    p_lay, d_lay = _layout(1), _layout(2)
    p = KvRankAgent("prefill-0@1#0", 0, [torch.zeros(4, LAYERS, 2, PS, KV, HD)], p_lay)
    d = KvRankAgent("decode-0@1#0", 0, [torch.zeros(4, LAYERS, 2, PS, 1, HD)], d_lay)
    try:
        dead = replace(d.meta(), agent=b"not an agent")
        assert p.connect("decode-0", d_lay, [dead, dead]) == 2
        failed = p.post("decode-0", "r1", [[0]], [[1]], b"note")
        assert [(e.piece.d_rank, e.ok) for e in failed] == [(0, False), (1, False)]
        assert all(e.reason.startswith("connect: ") for e in failed)
        assert not p.in_flight("r1")
        p.forget("decode-0")
    finally:
        p.close()
        d.close()
