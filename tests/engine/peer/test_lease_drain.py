"""P's source pages and the write that reads them (docs/reliability.md,
"Leases and fences"): P never frees or reuses a source page while a write
from it may still be reading it. A lease that runs out, or a release from
D, with the write posted and not yet ended stops the renewals and cancels
the write where the transport can; the pages stay pinned until the
transport says the write ended (done, failed or cancelled). Then nothing
is left: both engines end idle.

P and D are the engine fakes on one loopback fabric, so P's write lands in
D's pool. `hold_writes` keeps a write posted and not complete: it reads P's
pages only when the test lets it complete."""

import time

import torch

from pdserve.proto import control_pb2 as pb
from pdserve.engine.peer.messages import PeerRpc
from pdserve.scheduler import Request, SamplingLimits
from pdserve.transfer import FaultInjector, FaultRule, TransferEventKind
from pdserve.transfer.loopback import LoopbackFabric

from support.engine_fakes import ack, deliver, one_round, remote_prefill_asked, sent, server

LEASE_S = 10.0      # PeerTimeouts' default, as the fakes use it


def pair():
    fabric = LoopbackFabric()
    p = server("prefill", "prefill-0", "decode-0", fabric)
    d = server("decode", "decode-0", "prefill-0", fabric)
    # distinct, recognisable contents: P's page i holds i + 1; D's pool is empty
    p.transport.pool.copy_(torch.arange(1, p.transport.pool.shape[0] + 1, dtype=torch.float32)
                           .unsqueeze(1).expand_as(p.transport.pool))
    return p, d


def ask_and_ship(p, d, rid="x", can_cancel=False):
    """D asks P to prefill `rid`; P prefills it and posts the write, which
    the loopback holds posted and not complete. Returns the write."""
    r = Request(rid, list(range(1, 18)), SamplingLimits(max_new_tokens=3))
    r.peer = "prefill-0"
    d.planner.submit(r)
    d.owner[rid] = "router"
    one_round(d)
    (_, method, ask), = [m for m in sent(d) if m[2].request_id == rid]
    assert method is PeerRpc.REMOTE_PREFILL
    p.transport.hold_writes = True
    p.transport.can_cancel = can_cancel
    p.peer.remote_prefill(ask)
    for _ in range(20):
        one_round(p)
        if p.transport.in_flight(rid):
            break
    assert rid in p.planner.transferring and p.transport.in_flight(rid)
    (w,) = p.transport._posted
    return w


def poll(s):
    for ev in s.transport.poll():
        s.peer.on_transfer_event(ev)


def test_a_lease_that_runs_out_mid_write_keeps_the_source_pages_until_the_write_ends():
    """The write cannot be stopped (as with NIXL): P keeps the twin pinned
    past its lease, renews it no more, and lets it go when the write
    completes; D receives P's pages intact, not whatever reused them."""
    p, d = pair()
    w = ask_and_ship(p, d)
    want = p.transport.pool[list(w.src_pages)].clone()
    free = p.planner.free_pages()
    p.peer.timers(time.monotonic() + LEASE_S + 1)          # D fell silent
    assert p.counts.lease_expiries == 1
    assert "x" in p.planner.transferring, "source pages freed under a posted write"
    assert p.planner.free_pages() == free and not p.nothing_live()
    assert p.peer.heartbeat(pb.HeartbeatRequest(engine="decode-0", incarnation=1,
                                                request_ids=["x"])) == 0     # no revival
    p.planner.check_invariants()

    assert p.transport.complete_held("x") == 1             # the write reads them now
    poll(p)
    assert "x" not in p.planner.requests and p.peer.idle() and p.nothing_live()
    p.planner.assert_idle()

    poll(d)                                                # D's landing was still live
    assert "x" in d.planner.running
    assert torch.equal(d.transport.pool[list(w.dst_pages)], want)


def test_a_lease_that_runs_out_mid_write_cancels_a_write_the_transport_can_stop():
    """A held loopback write has read nothing: cancelling it ends it at
    once (CANCELLED), the pages go, and D, hearing nothing, times out,
    quarantines its landing pages and prefills the request itself; P,
    told, says no write of it is left, and the pages come back."""
    p, d = pair()
    ask_and_ship(p, d, can_cancel=True)
    p.peer.timers(time.monotonic() + LEASE_S + 1)
    assert "x" not in p.planner.requests and p.peer.idle()
    events = p.transport.poll()
    assert [e.kind for e in events] == [TransferEventKind.CANCELLED]
    for ev in events:
        p.peer.on_transfer_event(ev)
    p.planner.assert_idle()
    poll(d)
    assert "x" in d.planner.landing and torch.all(d.transport.pool == 0)
    now = time.monotonic()
    d.peer.timers(now + 31)                                # D's landing times out
    assert "x" not in d.planner.landing and d.counts.fences == 1
    for _ in range(50):
        if not one_round(d):
            break
    assert d.stats().quarantined_pages == 5                 # x's 17 tokens: 5 pages
    d.peer.timers(now + 1e6)                               # no clock frees them
    assert d.stats().quarantined_pages == 5
    deliver(d, p)                                          # the release, the heartbeat
    assert deliver(p, d) >= 1                              # TransferEnded
    assert d.stats().quarantined_pages == 0
    d.planner.assert_idle()


def test_a_release_from_d_mid_write_keeps_the_source_pages_until_the_write_ends():
    """D gives up (a timeout, an abort) and releases the twin while P's
    write is posted: the ack does not free the pages; the write's end does."""
    p, d = pair()
    w = ask_and_ship(p, d)
    free = p.planner.free_pages()
    p.peer.transfer_ack(ack("x", w.epoch, release_only=True))
    assert "x" in p.planner.transferring and p.planner.free_pages() == free
    assert len(p.peer.leases) == 0 and not p.peer.idle()
    p.transport.complete_held("x")
    poll(p)
    assert p.peer.idle() and p.nothing_live()
    p.planner.assert_idle()


def test_a_write_whose_completion_is_lost_still_releases_the_pages_once_it_ended():
    """A fault swallows the write's DONE: P does not rely on the event; the
    transport's `in_flight` says the write ended, and the next timer pass
    lets the pages go."""
    p, d = pair()
    ask_and_ship(p, d)
    p.transport.faults = FaultInjector([FaultRule("completion", "drop")])
    p.peer.timers(time.monotonic() + LEASE_S + 1)
    assert "x" in p.planner.transferring
    p.transport.complete_held("x")
    poll(p)                                                # DONE swallowed
    assert p.transport.faults.fired == [("completion", "drop", "x")]
    assert "x" in p.planner.transferring
    p.peer.timers(time.monotonic() + LEASE_S + 1)
    assert p.peer.idle() and p.nothing_live()
    p.planner.assert_idle()


def test_a_drain_deadline_on_p_mid_write_keeps_the_source_pages_until_the_write_ends():
    """P's drain deadline aborts what it holds; a twin whose write is in
    flight is let go like an expired lease, its pages pinned until the
    write completes, and the drain waits for it."""
    p, d = pair()
    w = ask_and_ship(p, d)
    free = p.planner.free_pages()
    p.abort_left()
    assert "x" in p.planner.transferring, "source pages freed under a posted write"
    assert p.planner.free_pages() == free and not p.nothing_live()
    p.planner.check_invariants()
    assert p.transport.complete_held("x") == 1
    poll(p)
    assert "x" not in p.planner.requests and p.peer.idle() and p.nothing_live()
    p.planner.assert_idle()
    assert w.req_id == "x"


def test_a_lease_that_runs_out_mid_round_posts_no_write():
    """P checks its leases before a round and ships after it, and a CPU
    round can outlast a lease: a twin whose lease ran out while it was
    prefilled is never posted, even with no timer pass between (D frees
    fenced pages once the lease is over, so a late write could land in
    pages it reused). The next timer pass lets the twin go."""
    p, d = pair()
    ask = remote_prefill_asked(d)
    p.transport.hold_writes = True
    p.peer.remote_prefill(ask)                             # the lease is granted now
    late = time.monotonic() + LEASE_S + 1
    p.peer.clock = lambda: late                            # ... and runs out mid-round
    for _ in range(20):
        if one_round(p) is None:
            break
    assert "x" in p.planner.transferring, "the twin never reached its ship"
    assert not p.transport.in_flight("x") and p.counts.transfers == 0
    poll(d)
    assert torch.all(d.transport.pool == 0)
    p.peer.timers(late)
    assert p.counts.lease_expiries == 1 and p.peer.idle() and p.nothing_live()
    p.planner.assert_idle()


def test_d_heartbeats_each_prefill_peer_once_a_heartbeat_period():
    """D renews P's leases with one heartbeat a peer every heartbeat_s,
    naming every request it waits on, not one on each pass of its loop
    (a pass can come every millisecond)."""
    p, d = pair()
    ask_and_ship(p, d)
    def beats():
        return [m for _, rpc, m in sent(d) if rpc is PeerRpc.LEASE_HEARTBEAT]
    now = time.monotonic()
    d.peer.timers(now)
    assert [list(m.request_ids) for m in beats()] == [["x"]]
    d.peer.timers(now + d.peer.heartbeat_s / 2)
    assert len(beats()) == 1
    d.peer.timers(now + d.peer.heartbeat_s)
    assert len(beats()) == 2
