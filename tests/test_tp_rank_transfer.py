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
from pdserve.transfer.rank_agent import KvRankAgent, decode_piece_notif
from pdserve.transfer.tp_pieces import (
    KvPiece, PageGeometry, bytes_per_rank, heads_of, piece_runs, plan_pieces)

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


def test_runs_are_whole_pages_only_when_both_sides_hold_exactly_the_heads():
    full = piece_runs(KvPiece(0, 0, 0, 1, 0, 0), _layout(2), _layout(2), 0, 4)
    assert full == ([(0, LAYERS * 2 * PS * HD * 4)],) * 2
    p_runs, d_runs = piece_runs(KvPiece(0, 1, 1, 1, 1, 0), _layout(1), _layout(2), 0, 4)
    assert len(p_runs) == len(d_runs) == LAYERS * 2 * PS       # one per (layer, K/V, token)
    assert p_runs[:2] == [(HD * 4, HD * 4), (2 * HD * 4 + HD * 4, HD * 4)]
    assert d_runs[:2] == [(0, HD * 4), (HD * 4, HD * 4)]
    with pytest.raises(ValueError, match=r"heads \[1, 3\) of a page of 2"):
        PageGeometry(LAYERS, PS, 2, HD, 4).runs(1, 2)


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


def _drain(agents, pieces, tag, bound_s=20.0):
    """Poll every agent until each P rank's pieces ended and each D rank got
    its pieces' notifications; (ends, notifications by D rank)."""
    p_agents, d_agents = agents
    ends, notifs = [], {r: [] for r in range(len(d_agents))}
    want_notifs = {r: sum(1 for x in pieces if x.d_rank == r) for r in notifs}
    deadline = time.monotonic() + bound_s
    while len(ends) < len(pieces) or any(len(notifs[r]) < n for r, n in want_notifs.items()):
        assert time.monotonic() < deadline, (ends, notifs)
        for a in p_agents:
            ends += a.poll()[0]
        for r, a in enumerate(d_agents):
            notifs[r] += a.poll()[1]
    return ends, notifs


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1), (2, 2)])
def test_nixl_rank_to_rank_lands_each_d_rank_its_heads_byte_for_byte(p, d):
    torch.manual_seed(p * 10 + d)
    pages = 12
    whole = torch.randn(pages, LAYERS, 2, PS, KV, HD)
    p_lay, d_lay = _layout(p), _layout(d)
    p_shards = _shards(whole, p_lay)
    d_shards = [torch.zeros_like(s) for s in _shards(whole, d_lay)]
    p_agents = [KvRankAgent(f"prefill-0@1#{r}", r, [s], p_lay) for r, s in enumerate(p_shards)]
    d_agents = [KvRankAgent(f"decode-0@1#{r}", r, [s], d_lay) for r, s in enumerate(d_shards)]
    try:
        metas = [a.meta() for a in d_agents]
        sent = [a.connect("decode-0", d_lay, metas) for a in p_agents]
        pieces = plan_pieces(p_lay, d_lay)
        assert sum(sent) == len(pieces)
        src, dst = [1, 2, 3, 7], [8, 9, 10, 0]
        for a in p_agents:
            assert a.post("decode-0", "r1", [src], [dst], b"note") == []
        ends, notifs = _drain((p_agents, d_agents), pieces, "r1")
        assert all(e.ok for e in ends) and sorted(e.piece for e in ends) == sorted(pieces)
        for r, msgs in notifs.items():
            got = sorted(decode_piece_notif(m) for m in msgs)
            assert got == sorted((x.p_rank, x.d_rank, b"note") for x in pieces if x.d_rank == r)
        for want, shard in zip(_shards(whole[src], d_lay), d_shards):
            assert torch.equal(shard[dst].view(torch.uint8), want.view(torch.uint8))
        untouched = [i for i in range(pages) if i not in dst]
        assert all(not s[untouched].any() for s in d_shards)
        assert not any(a.in_flight("r1") for a in p_agents)
        per_page = sum(a.descriptors for a in p_agents) // len(src)
        assert per_page == (len(pieces) if p == d else len(pieces) * LAYERS * 2 * PS)
    finally:
        for a in p_agents + d_agents:
            a.close()
