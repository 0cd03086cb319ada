"""A frozen peer (a GC or swap pause, SIGSTOP, a stuck loop) or a stalled
link never corrupts KV (issue 53, docs/reliability.md "Frozen peers"):

- stale work is refused, not run: a job its caller gave up on is dropped,
  an expired lease is never renewed, and a thawed engine reads its clocks
  before its queue;
- D never reuses a page a write may still reach: a landing it gave up on
  stays quarantined until P says no write of it is left, or P's
  incarnation is gone, and no clock frees it;
- a message from an incarnation older than the one known is ignored and
  counted;
- a hung peer delays no message to another.

P and D are the engine fakes on one loopback fabric (P's writes land in D's
pool); what one sends the other is handed over by `deliver`, or not, as
each test needs."""

import threading
import time

import grpc
import pytest
import torch

from pdserve.engine.peer.messages import Peer, PeerRpc, PeerSender
from pdserve.engine.rpc import EngineControlServicer
from pdserve.proto import control_pb2 as pb
from pdserve.scheduler import Request, SamplingLimits
from pdserve.transfer import FaultInjector, FaultRule

from support.engine_fakes import (LEASE_S, OLD_FENCE_S, TRANSFER_S, ack, asked, deliver,
                                  fenced_pages, finish, one_round, pair, remote_prefill_asked,
                                  run_jobs, sent)


class Clock:
    """A monotonic clock a test moves by hand."""

    def __init__(self):
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def inline(s):
    """`s`'s handlers, running their loop-thread work inline (a thawed loop
    running what its handlers queued)."""
    s.call = lambda fn, timeout=30.0: fn()
    return EngineControlServicer(s)


class Ctx:
    def __init__(self, left: float = 10.0):
        self.left = left

    def time_remaining(self):
        return self.left

    def abort(self, code, details):
        raise AssertionError(f"{code}: {details}")


# ---- the reproduction -----------------------------------------------

def test_a_p_that_thaws_with_old_work_queued_writes_into_no_page_d_gave_back():
    """P freezes with D's RemotePrefill and a heartbeat queued. D's landing
    times out; D prefills the request itself; D's old fence time (lease +
    heartbeat + landing timeout) passes; D serves another request. P thaws
    and runs what queued: the ask, the heartbeat (D's release of the twin
    was lost), and ships. Whatever P's write reaches must be a page still
    quarantined for it (today: the expired fence freed pages 0-4 and P
    overwrote them); the quarantine comes back once P says the write ended
    (its notification lost), and both engines end idle."""
    p, d = pair()
    now = time.monotonic()
    ask = remote_prefill_asked(d)                       # x: landing pages 0-4
    d.peer.timers(now)                                  # a heartbeat naming x
    (hb,) = [m for _, rpc, m in sent(d) if rpc is PeerRpc.LEASE_HEARTBEAT]
    d.peer.timers(now + TRANSFER_S + 1)                 # x's landing times out
    assert d.counts.fences == 1
    d.peer.timers(now + TRANSFER_S + OLD_FENCE_S + 2)   # past where the fence used to lift
    y = Request("y", list(range(100, 117)), SamplingLimits(max_new_tokens=30))
    d.planner.submit(y)
    d.owner["y"] = "router"
    for _ in range(3):                                  # x prefills locally, y starts
        one_round(d)
    guarded = fenced_pages(d)
    before = d.transport.pool.clone()
    d.transport.faults = FaultInjector([FaultRule("notification", "drop", req_id="x")])

    p_rpc = inline(p)                                   # P thaws: its queue runs
    p_rpc.RemotePrefill(ask, Ctx())
    p_rpc.LeaseHeartbeat(hb, Ctx())
    for _ in range(20):
        one_round(p)
    reached = {i for i in range(before.shape[0])
               if not torch.equal(d.transport.pool[i], before[i])}
    assert reached <= guarded, f"P wrote pages {sorted(reached - guarded)} D had given back"

    for ev in d.transport.poll():                       # the notification is lost
        d.peer.on_transfer_event(ev)
    assert len(d.peer.quarantined()) == 1
    d.peer.sender.delivered.update(range(2))            # the ask and heartbeat, handled above
    deliver(d, p)                                       # D's release, late; heartbeats (fenced)
    for ev in p.transport.poll():
        p.peer.on_transfer_event(ev)
    assert deliver(p, d) >= 1                           # P: no write of x is left
    assert d.peer.quarantined() == [] and d.stats().quarantined_pages == 0
    finish(d)
    finish(p)
    p.peer.timers(time.monotonic() + 2 * LEASE_S)
    assert p.peer.idle() and d.peer.idle() and len(d.peer.landing) == 0
    p.planner.assert_idle()
    d.planner.assert_idle()


def test_a_write_that_lands_long_after_d_gave_up_reaches_only_its_quarantined_pages():
    """The link stalls with P's write posted (loopback holds it); D gives
    up, no clock frees the pages, D serves another request meanwhile; the
    write lands a long time after: only in x's quarantined pages, and its
    notification gives them back."""
    p, d = pair()
    ask = remote_prefill_asked(d)
    p.transport.hold_writes, p.transport.can_cancel = True, False
    p.peer.remote_prefill(ask)
    for _ in range(20):
        one_round(p)
        if p.transport.in_flight("x"):
            break
    now = time.monotonic()
    d.peer.timers(now + TRANSFER_S + 1)
    d.peer.timers(now + 100 * OLD_FENCE_S)
    y = Request("y", list(range(100, 117)), SamplingLimits(max_new_tokens=30))
    d.planner.submit(y)
    d.owner["y"] = "router"
    for _ in range(3):
        one_round(d)
    guarded, before = fenced_pages(d), d.transport.pool.clone()
    assert len(guarded) == 5
    assert p.transport.complete_held("x") == 1
    reached = {i for i in range(before.shape[0])
               if not torch.equal(d.transport.pool[i], before[i])}
    assert reached and reached <= guarded
    for ev in d.transport.poll():
        d.peer.on_transfer_event(ev)                    # DRAINED: the pages come back
    assert d.peer.quarantined() == [] and fenced_pages(d) == set()


# ---- stale work is refused ---------------------------------------------------

def test_a_job_past_its_callers_deadline_is_not_run_and_the_caller_hears_at_once():
    """A handler's call waits 10 s for the loop; the loop is frozen for
    longer. When it thaws, the job is dropped (counted), not run, and the
    caller, still waiting, is told at once."""
    p, _ = pair()
    clock = Clock()
    p.inbox.clock = clock
    queued, ran, outcome = threading.Event(), [], []
    post = p.inbox.post

    def counted_post(*args, **kw):
        ok = post(*args, **kw)
        queued.set()
        return ok
    p.inbox.post = counted_post

    def caller():
        try:
            p.call(lambda: ran.append(1), timeout=10.0)
            outcome.append("ran")
        except TimeoutError:
            outcome.append("timed out")
    t = threading.Thread(target=caller, daemon=True)
    t.start()
    assert queued.wait(10)
    clock.now += 11.0                                   # the freeze outlasts the caller
    run_jobs(p)
    t.join(10)
    assert not ran and outcome == ["timed out"] and p.counts.stale_jobs == 1


def test_a_job_within_its_callers_deadline_runs():
    p, _ = pair()
    clock = Clock()
    p.inbox.clock = clock
    ran = []
    assert p.post_job(lambda: ran.append(1), deadline=clock.now + 10.0)
    clock.now += 9.9
    run_jobs(p)
    assert ran == [1] and p.counts.stale_jobs == 0


def test_a_thawed_engine_reads_its_clocks_before_its_queue():
    """P holds a twin whose lease ran out while P was frozen, and a job
    queued meanwhile: the pass expires the lease first, then runs the job
    (which, a heartbeat, would otherwise renew what D gave up on)."""
    p, d = pair()
    clock = Clock()
    for part in (p.peer, p.inbox, p.loop):
        part.clock = clock
    p.peer.remote_prefill(remote_prefill_asked(d))
    clock.now += LEASE_S + 1
    seen = []
    p.post_job(lambda: seen.append(len(p.peer.leases)))
    p.loop.tick()
    assert seen == [0] and p.counts.lease_expiries == 1


def test_an_old_heartbeat_renews_no_lease_that_expired_before_it_ran():
    p, d = pair()
    clock = Clock()
    p.peer.clock = clock
    p.peer.remote_prefill(remote_prefill_asked(d))
    clock.now += LEASE_S + 1                            # not swept yet
    hb = pb.HeartbeatRequest(engine="decode-0", incarnation=1, request_ids=["x"])
    assert p.peer.heartbeat(hb) == 0
    assert not p.peer.leases.holds("x", clock.now)


# ---- the quarantine ----------------------------------------------------------

def test_an_ask_that_arrives_after_p_said_the_landing_ended_is_refused():
    """D gave up on x (an abort right after the ask); its release reached P
    before the ask did (reordered). P says the landing ended, D frees the
    pages; the late ask must then not start a write into them."""
    p, d = pair()
    ask = remote_prefill_asked(d)
    d.abort("x", "client left")
    assert len(d.peer.quarantined()) == 1
    d.peer.sender.delivered.add(0)                      # the ask is still on its way
    deliver(d, p)                                       # the release comes first
    deliver(p, d)
    assert d.peer.quarantined() == [] and fenced_pages(d) == set()
    with pytest.raises(Exception, match="came too late"):
        p.peer.remote_prefill(ask)
    assert not p.planner.requests and p.peer.idle()


def test_a_quarantine_held_for_a_restarted_p_comes_back_when_membership_says_so():
    """P froze (or its link broke) mid-write and Ray restarted it: the
    router introduces prefill-0@2. The @1 that was asked writes nothing
    more: its quarantined landing comes back, and a landing still waiting
    on it is prefilled on D at once."""
    _, d = pair()
    remote_prefill_asked(d, "x")
    d.peer.timers(time.monotonic() + TRANSFER_S + 1)
    asked(d, "w")
    assert len(d.peer.quarantined()) == 1 and "w" in d.planner.landing
    d.peer.add_peer(pb.AddPeerRequest(engine="prefill-0", incarnation=2, address="nowhere:0",
                                      nixl_metadata=b"prefill-0@2"))
    assert d.peer.quarantined() == [] and "w" not in d.planner.landing
    assert d.counts.failures_by_stage.get("prefill_gone") == 1
    finish(d)
    d.planner.assert_idle()


def test_a_p_ray_reports_gone_gives_back_what_d_held_for_it_through_remove_peer():
    """P died and Ray cannot (or has not yet) brought it back: it never
    sends TransferEnded, and no newer incarnation is introduced. The
    router's RemovePeer for prefill-0@1 is what frees D's quarantined
    landing and prefills the waiting one on D."""
    _, d = pair()
    remote_prefill_asked(d, "x")
    d.peer.timers(time.monotonic() + TRANSFER_S + 1)
    asked(d, "w")
    assert len(d.peer.quarantined()) == 1 and "w" in d.planner.landing
    gone = pb.RemovePeerRequest(engine="prefill-0",
                                incarnation=d.peer.peers["prefill-0"].incarnation)
    inline(d).RemovePeer(gone, Ctx())
    assert d.peer.quarantined() == [] and d.stats().quarantined_pages == 0
    assert "w" not in d.planner.landing
    assert d.counts.failures_by_stage.get("prefill_gone") == 1
    finish(d)
    d.planner.assert_idle()


def test_a_p_that_drained_and_stopped_gives_back_what_d_held_for_it():
    """D gave up on x and holds its pages quarantined; P drains and stops
    before D's question reaches it. Stopping, P tells D that no write of
    this incarnation is left: D frees the pages without waiting for a P
    that is gone."""
    p, d = pair()
    remote_prefill_asked(d)
    d.peer.timers(time.monotonic() + TRANSFER_S + 1)
    finish(d)
    assert len(d.peer.quarantined()) == 1
    d.peer.sender.delivered.update(range(len(sent(d))))  # lost with P's stop
    p.peer.stopped()
    assert deliver(p, d) == 1
    assert d.peer.quarantined() == [] and d.stats().quarantined_pages == 0
    d.planner.assert_idle()


def test_quarantined_pages_are_counted_and_the_planner_cannot_give_them_out():
    """The stats count them (pdserve stats, the metric); the planner's
    free pages do not include them, and its invariants hold."""
    _, d = pair()
    free = d.planner.free_pages()
    remote_prefill_asked(d)
    d.peer.timers(time.monotonic() + TRANSFER_S + 1)
    finish(d)
    st = d.stats()
    assert st.quarantined_pages == 5 and st.pinned_pages >= 5
    assert d.planner.free_pages() == free - 5
    d.planner.check_invariants()
    inline(d)
    assert d.check()["quarantined"] == 1 and not d.check()["idle"]


# ---- incarnations ------------------------------------------------------------

def test_messages_from_an_older_incarnation_are_ignored_and_counted():
    """D restarted (decode-0@2 now known to P): decode-0@1's heartbeat and
    ack change nothing on P (the lease is not renewed, the twin not let
    go), and each is counted. The same on D for prefill-0@1's
    TransferFailed and TransferEnded once prefill-0@2 is known."""
    p, d = pair()
    clock = Clock()
    p.peer.clock = clock
    p.peer.remote_prefill(remote_prefill_asked(d))
    p.peer.add_peer(pb.AddPeerRequest(engine="decode-0", incarnation=2, address="nowhere:0",
                                      nixl_metadata=b"decode-0@2"))
    clock.now += LEASE_S / 2
    p_rpc = inline(p)
    p_rpc.LeaseHeartbeat(pb.HeartbeatRequest(engine="decode-0", incarnation=1,
                                             request_ids=["x"]), Ctx())
    p_rpc.TransferAck(ack("x", 1, incarnation=1), Ctx())
    assert "x" in p.planner.requests and not p.peer.leases.holds("x", clock.now + LEASE_S / 2)
    assert p.counts.stale_messages == 2

    _, d = pair()
    remote_prefill_asked(d)
    d.peer.add_peer(pb.AddPeerRequest(engine="prefill-0", incarnation=2, address="nowhere:0",
                                      nixl_metadata=b"prefill-0@2"))
    epoch = asked(d, "z")
    d.peer.transfer_failed_from_peer(pb.TransferFailedRequest(
        request_id="z", epoch=epoch, reason="x", engine="prefill-0", incarnation=1))
    d.peer.transfer_ended_from_peer(pb.TransferEndedRequest(
        request_id="z", epoch=epoch, engine="prefill-0", incarnation=1))
    assert "z" in d.planner.landing and d.counts.stale_messages == 2


def test_a_remote_prefill_meant_for_another_incarnation_of_p_is_refused():
    p, d = pair()
    ask = remote_prefill_asked(d)
    ask.prefill_incarnation = 7
    with pytest.raises(Exception, match="the ask is for prefill-0@7"):
        p.peer.remote_prefill(ask)
    assert not p.planner.requests


def test_an_engines_incarnation_grows_with_every_restart_and_every_new_creation():
    """Ray's restart count orders restarts whatever the node's clock says;
    the creator's clock orders actors made again under the same name."""
    from pdserve.cluster.actors import engine_incarnation

    first = engine_incarnation(created_ms=1_000, restarts=0)
    assert engine_incarnation(1_000, 1) > first
    assert engine_incarnation(1_000, 2) > engine_incarnation(1_000, 1)
    assert engine_incarnation(1_001, 0) > engine_incarnation(1_000, 1000)
    assert engine_incarnation(2**40, 2**20 - 1) < 2**64            # a proto uint64
    with pytest.raises(ValueError):
        engine_incarnation(1_000, 2**20)


# ---- one queue per peer ------------------------------------------------------

class Stub:
    """An EngineControl stub whose calls record their message; a `hung`
    one holds every call until `release` is set (a frozen peer)."""

    def __init__(self, hung: bool = False):
        self.release = threading.Event()
        if not hung:
            self.release.set()
        self.got: list = []
        self.arrived = threading.Event()

    def _call(self, request, timeout=None):
        self.got.append(request)
        self.arrived.set()
        self.release.wait()

    RemotePrefill = TransferAck = TransferFailed = LeaseHeartbeat = TransferEnded = _call


def test_a_hung_peer_delays_no_heartbeat_to_another_peer():
    """Heartbeats and asks pile up for a frozen P (its call held); a
    heartbeat to a healthy P goes out at once, and the frozen P's queue
    holds one heartbeat, not twenty."""
    sender = PeerSender("decode-0")
    frozen, healthy = Stub(hung=True), Stub()
    p1, p2 = Peer("prefill-1", 1, "x:1", frozen), Peer("prefill-2", 1, "x:2", healthy)
    try:
        for i in range(20):
            sender.send(p1, PeerRpc.REMOTE_PREFILL, pb.RemotePrefillRequest(request_id=f"r{i}"))
            sender.send(p1, PeerRpc.LEASE_HEARTBEAT, pb.HeartbeatRequest(engine="decode-0"))
        assert frozen.arrived.wait(10)
        sender.send(p2, PeerRpc.LEASE_HEARTBEAT, pb.HeartbeatRequest(engine="decode-0"))
        assert healthy.arrived.wait(5), "the healthy peer's heartbeat waited behind the hung one"
        assert sender.queued("prefill-1") == 20        # 19 asks and one heartbeat
    finally:
        frozen.release.set()
        sender.close()


def test_a_full_peer_queue_refuses_the_new_message_as_never_sent():
    """Past its bound of messages waiting for one peer, a new one is not
    queued: its sender hears RESOURCE_EXHAUSTED at once (never sent: D
    prefills the request itself, with nothing to quarantine)."""
    sender = PeerSender("decode-0", bound=3)
    frozen = Stub(hung=True)
    peer = Peer("prefill-1", 1, "x:1", frozen)
    codes: list = []
    try:
        sender.send(peer, PeerRpc.REMOTE_PREFILL, pb.RemotePrefillRequest(request_id="r0"))
        assert frozen.arrived.wait(10)                  # r0 is in its call; 3 may wait
        for i in range(1, 5):
            sender.send(peer, PeerRpc.REMOTE_PREFILL, pb.RemotePrefillRequest(request_id=f"r{i}"),
                        on_error=codes.append)
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED]
    finally:
        frozen.release.set()
        sender.close()


def test_a_message_that_waited_out_its_deadline_behind_a_hung_call_is_not_sent():
    """r1 waits behind r0's call to a frozen peer past its own deadline: it
    is dropped unsent (RESOURCE_EXHAUSTED: D knows the peer never saw it)."""
    clock = Clock()
    sender = PeerSender("decode-0", clock=clock)
    frozen = Stub(hung=True)
    peer = Peer("prefill-1", 1, "x:1", frozen)
    heard, codes = threading.Event(), []

    def on_error(code):
        codes.append(code)
        heard.set()
    try:
        sender.send(peer, PeerRpc.REMOTE_PREFILL, pb.RemotePrefillRequest(request_id="r0"))
        sender.send(peer, PeerRpc.REMOTE_PREFILL, pb.RemotePrefillRequest(request_id="r1"),
                    on_error=on_error)
        assert frozen.arrived.wait(10)
        clock.now += sender.timeout_s + 1
        frozen.release.set()                            # r0's call ends; r1's time is up
        assert heard.wait(10)
        assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert [m.request_id for m in frozen.got] == ["r0"]
    finally:
        frozen.release.set()
        sender.close()
