"""P/D between engines of different (or equal) tensor-parallel sizes, below
the cluster, KV moved rank to rank: every rank of the TP 2 engine (rank 0
and its worker process) its own NIXL agent (engine/tp/kv_ranks.py). For P TP
2 -> D TP 1, P TP 1 -> D TP 2 and P TP 2 -> D TP 2, each D rank ends with
exactly its heads of the pages, every byte (against the TP 1 engine's
pages, and the TP 2 engine's own); through the transports, P's write is
DONE once every P rank's pieces ended and D's LANDED once every D rank has
its pieces. Two transports whose pages cannot be mapped are refused at the
handshake with both sides named. (Through `pdserve up`: test_tp_pd_up.py.)"""

import time

import pytest
import torch

from pdserve.kernels.models.loader import load_model
from pdserve.engine.tp.leader import TpLeader
from pdserve.engine.tp.worker import TpSpec
from pdserve.transfer import Incarnation, KvWrite, TransferEventKind
from pdserve.transfer.kv_layout import KvLayout
from pdserve.transfer.loopback import LoopbackFabric, LoopbackTransport
from support.tp import PAGES, PS, greedy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
STEPS = 4
USED = [p for s in range(len(PROMPTS)) for p in range(s * PAGES, s * PAGES + 4)]


def _layout(tp: int, **kw) -> KvLayout:
    base = dict(tensor_parallel_size=tp, kv_heads=2, head_dim=16, dtype="float32", page_size=PS,
                layers=(2,))
    return KvLayout(**{**base, **kw})


@pytest.fixture(scope="module")
def engines():
    """(a TP 1 model with its caches after the greedy run, a TP 2 rank 0 after
    the same run): the TP 1 engine's pages are the reference."""
    ref, _ = load_model(None, "tiny", dtype="float32", attention="torch")
    ref_caches: list = []
    real_new = ref.new_caches

    def keep(*a):
        ref_caches[:] = real_new(*a)
        return ref_caches
    ref.new_caches = keep
    _, want = greedy(ref, PROMPTS, STEPS)
    leader = TpLeader(TpSpec(None, "tiny", "float32", "torch", "cpu", 2, 30.0))
    _, got = greedy(leader, PROMPTS, STEPS)
    assert got == want              # the TP 2 engine computed the same tokens
    yield ref_caches[0].data, leader
    leader.close()


@pytest.mark.parametrize("field,value,named", [
    ("kv_heads", 4, "KV heads"), ("dtype", "bfloat16", "dtype"), ("page_size", 8, "page size"),
    ("head_dim", 32, "head size")])
def test_pages_that_cannot_be_mapped_are_refused_naming_both_sides(field, value, named):
    """Sizes may differ; the model's KV geometry, dtype and page size may not."""
    fabric = LoopbackFabric()
    P = LoopbackTransport(Incarnation("prefill-0", 1), fabric)
    D = LoopbackTransport(Incarnation("decode-0", 1), fabric)
    P.register_pools([torch.zeros(4, 8)], layout=_layout(2))
    D.register_pools([torch.zeros(4, 8)], layout=_layout(1, **{field: value}))
    with pytest.raises(ValueError, match=rf"prefill-0 \(tensor_parallel_size 2: .*\) and "
                                         rf"decode-0 \(tensor_parallel_size 1: .*\) cannot "
                                         rf"exchange KV pages: their {named} differ"):
        P.add_peer(D.incarnation, D.metadata())
    assert P.peers() == []


def test_nixl_metadata_carries_the_layout_and_refuses_a_mismatch():
    from pdserve.transfer.nixl.transport import NixlTransport

    a, b = NixlTransport(Incarnation("prefill-0", 1)), NixlTransport(Incarnation("decode-0", 1))
    try:
        a.register_pools([torch.zeros(4, 8)], layout=_layout(2))
        b.register_pools([torch.zeros(4, 8)], layout=_layout(1, page_size=8))
        with pytest.raises(ValueError, match="decode-0 .* cannot exchange KV pages: their page "
                                             "size differ"):
            a.add_peer(b.incarnation, b.metadata())
        c = NixlTransport(Incarnation("decode-1", 1))
        try:
            c.register_pools([torch.zeros(4, 8)], layout=_layout(1))
            a.add_peer(c.incarnation, c.metadata())     # TP 2 and TP 1 of one model: mapped
            assert a.peers() == [c.incarnation]
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_prefill_and_decode_roles_may_be_tensor_parallel():
    from pdserve.config import ServeConfig, role_engine

    cfg = ServeConfig.from_dict({"cluster": {"prefill": {"count": 1, "tensor_parallel_size": 2},
                                             "decode": 1}})
    assert role_engine(cfg, "prefill").tensor_parallel_size == 2
    assert role_engine(cfg, "decode").tensor_parallel_size == 1


# ---- per-rank: every rank of the TP 2 engine its own NIXL agent (engine/tp/kv_ranks.py) ----

def _until(cond, bound_s=30.0):
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, "the per-rank write did not end in time"


def _rank_write(p_agents, p_poll, d_poll, d_ranks, pieces, src, dst):
    """Post on every P rank; poll until every piece ended on P and every D
    rank reported the write once."""
    for post in p_agents:
        post("decode-0", "r", [src], [dst], b"w1")
    ends, landed = [], []

    def done():
        ends.extend(e for polled in p_poll() for e in polled.ends)
        landed.extend(x for polled in d_poll() for x in polled.landed)
        return len(ends) == pieces and len(landed) == d_ranks
    _until(done)
    assert all(e.ok for e in ends), ends
    assert sorted(x.notif for x in landed) == [b"w1"] * d_ranks


class _Polled:
    """One in-process agent's poll as a TpKvPolled-like answer."""

    def __init__(self, agent):
        self.agent = agent

    def __call__(self):
        from pdserve.engine.tp.kv_ranks import TpKvPolled

        ends, landed, dropped = self.agent.poll()
        assert dropped == 0
        return [TpKvPolled(0, tuple(ends), tuple(landed), dropped)]


def test_per_rank_p_tp2_to_d_tp1_each_p_rank_writes_its_head(engines):
    """P's two ranks (rank 0 and the worker process) each write their own
    head of the pages straight into D's one rank; D's pages are P's ranks'
    heads side by side, every byte, and match the TP 1 engine's."""
    from pdserve.engine.tp.kv_ranks import TpKvRanks
    from pdserve.transfer.tp.rank_agent import KvRankAgent

    ref, leader = engines
    d_pool = torch.zeros_like(ref)
    p = TpKvRanks(leader, "prefill-0@1", _layout(2))
    d = KvRankAgent("decode-0@1#0", 0, [d_pool], _layout(1))
    try:
        d.accept("prefill-0", _layout(2), list(p.metas))
        p.connect("decode-0", _layout(1), [d.meta()])
        dst = list(range(len(USED)))
        _rank_write([p.post], p.poll, _Polled(d), 1, 2, USED, dst)
        got = d_pool[dst]
        heads = leader.gather_pages(0, USED)
        assert torch.equal(got.view(torch.uint8), torch.cat(heads, dim=-2).view(torch.uint8))
        assert torch.equal(got[:, 0].view(torch.uint8), ref[USED][:, 0].view(torch.uint8))
        torch.testing.assert_close(got, ref[USED], rtol=0, atol=2e-6)
        assert d.unpacked_bytes == ref[USED].nbytes          # both heads landed as blocks
    finally:
        p.forget("decode-0")
        p.close()
        d.close()


def test_per_rank_p_tp1_to_d_tp2_each_d_rank_gets_its_head(engines):
    """A TP 1 P packs each head and writes it to the D rank that owns it:
    each of D's ranks (rank 0 and the worker process) holds exactly the
    reference's head of the pages, every byte."""
    from pdserve.engine.tp.kv_ranks import TpKvRanks
    from pdserve.transfer.tp.rank_agent import KvRankAgent

    ref, leader = engines
    src_pool = ref.clone()
    p = KvRankAgent("prefill-0@1#0", 0, [src_pool], _layout(1))
    d = TpKvRanks(leader, "decode-0@1", _layout(2))
    far = list(range(4, 4 + len(USED)))         # pages the greedy run left empty
    try:
        d.accept("prefill-0", _layout(1), [p.meta()])
        p.connect("decode-0", _layout(2), list(d.metas))
        _rank_write([p.post], _Polled(p), d.poll, 2, 2, USED, far)
        parts = leader.gather_pages(0, far)
        want = ref[USED]
        for r in range(2):
            assert torch.equal(parts[r].view(torch.uint8),
                               want[..., r:r + 1, :].contiguous().view(torch.uint8))
        assert p.packed_bytes == want.nbytes
    finally:
        d.close()
        p.close()


def test_per_rank_p_tp2_to_d_tp2_rank_to_rank_whole_pages(engines):
    """The same TP 2 engine as P (its first pages) and as D (empty pages),
    an agent per rank for each: rank r writes rank r whole pages, nothing
    packed; D's pages on each rank equal P's, every byte."""
    from pdserve.engine.tp.kv_ranks import TpKvRanks

    ref, leader = engines
    p = TpKvRanks(leader, "prefill-0@1", _layout(2))
    d = TpKvRanks(leader, "decode-0@1", _layout(2))
    far = list(range(PAGES + 4, PAGES + 4 + len(USED)))
    try:
        d.accept("prefill-0", _layout(2), list(p.metas))
        p.connect("decode-0", _layout(2), list(d.metas))
        _rank_write([p.post], p.poll, d.poll, 2, 2, USED, far)
        for a, b in zip(leader.gather_pages(0, USED), leader.gather_pages(0, far)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    finally:
        p.close()
        d.close()



def test_per_rank_through_nixl_transports_p_tp2_to_d_tp1(engines):
    """The transports' per-rank path (transfer/tp/rank_writes.py): P's write is
    DONE once both P ranks' pieces ended, D's LANDED once its rank has both
    pieces, with the first token; D's pages are P's ranks' heads, every
    byte; nothing stays in flight."""
    from pdserve.engine.tp.kv_ranks import TpKvRanks
    from pdserve.transfer.nixl.transport import NixlTransport
    from pdserve.transfer.tp.rank_agent import LocalRanks

    ref, leader = engines
    d_pool = torch.zeros_like(ref)
    P = NixlTransport(Incarnation("prefill-0", 1))
    D = NixlTransport(Incarnation("decode-0", 1))
    try:
        P.register_pools([c.data for c in leader.caches], layout=_layout(2))
        P.use_ranks(TpKvRanks(leader, P.incarnation.agent_name, _layout(2)))
        D.register_pools([d_pool], layout=_layout(1))
        D.use_ranks(LocalRanks(D.incarnation.agent_name, [d_pool], _layout(1)))
        P.add_peer(D.incarnation, D.metadata())
        D.add_peer(P.incarnation, P.metadata())
        dst = list(range(len(USED)))
        P.write(KvWrite("r", 1, D.incarnation, tuple(USED), tuple(dst), first_token=3))
        p_events, d_events = [], []
        _until(lambda: (p_events.extend(P.poll()), d_events.extend(D.poll()),
                        bool(p_events) and bool(d_events))[-1])
        assert [e.kind for e in p_events] == [TransferEventKind.DONE]
        assert [(e.kind, e.req_id, e.first_token, e.peer) for e in d_events] == \
            [(TransferEventKind.LANDED, "r", 3, P.incarnation)]
        assert not P.in_flight("r")
        heads = leader.gather_pages(0, USED)
        assert torch.equal(d_pool[dst].view(torch.uint8),
                           torch.cat(heads, dim=-2).view(torch.uint8))
    finally:
        P.close()
        D.close()
