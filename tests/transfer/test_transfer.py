"""The transport contract, run against both backends (in-process NIXL over
UCX, with and without its progress thread, and the loopback fake), plus
fault injection, fences and leases."""

import time

import pytest
import torch

from pdserve.transfer import (
    FaultInjector, FaultRule, Incarnation, KvWrite, LandingTable, LandingVerdict, LeaseTable,
    TransferEventKind, page_runs)
from pdserve.transfer.loopback import LoopbackFabric, LoopbackTransport

DONE, FAILED, LANDED = (
    TransferEventKind.DONE, TransferEventKind.FAILED, TransferEventKind.LANDED)
PAGES, PAGE_SHAPE = 32, (2, 2, 4, 2, 8)      # [layers, k/v, page_size, kv_heads, head_dim]


def pool(fill: float | None = None):
    if fill is None:
        return torch.arange(PAGES * 2 * 2 * 4 * 2 * 8, dtype=torch.float32).view(PAGES, *PAGE_SHAPE)
    return torch.full((PAGES, *PAGE_SHAPE), fill)


class Pair:
    """P and D transports with their pools, peers added both ways."""

    def __init__(self, backend, p_faults=None, d_faults=None):
        self.backend = backend        # nixl*: NIXL reports what it moved (telemetry)
        self.fabric = LoopbackFabric()
        self.P = self.make(Incarnation("prefill-0", 1), p_faults)
        self.D = self.make(Incarnation("decode-0", 1), d_faults)
        self.P.register_pool(pool())
        self.D.register_pool(pool(-1.0))
        self.P.add_peer(self.D.incarnation, self.D.metadata())
        self.D.add_peer(self.P.incarnation, self.P.metadata())

    def make(self, inc, faults=None):
        if self.backend.startswith("nixl"):
            from pdserve.transfer.nixl.agent import PROGRESS_WAKE_US
            from pdserve.transfer.nixl.transport import NixlTransport

            wake = None if self.backend == "nixl-polled" else PROGRESS_WAKE_US
            return NixlTransport(inc, faults, telemetry=True, progress_wake_us=wake)
        return LoopbackTransport(inc, self.fabric, faults)

    def write(self, src, dst, req="r1", epoch=1, target=None):
        self.P.write(KvWrite(req, epoch, target or self.D.incarnation, tuple(src), tuple(dst)))

    def settle(self, want_p=1, want_d=1, seconds=5.0):
        """Poll both sides until the expected events arrived, or `seconds`
        passed (a test expecting silence waits the whole bound)."""
        p_ev, d_ev = [], []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            p_ev += self.P.poll()
            d_ev += self.D.poll()
            if len(p_ev) >= want_p and len(d_ev) >= want_d:
                break
        return p_ev, d_ev

    def close(self):
        self.P.close()
        self.D.close()


@pytest.fixture(params=["loopback", "nixl", "nixl-polled"])
def backend(request):
    return request.param


def test_page_runs_coalesce_only_where_both_sides_are_consecutive():
    assert page_runs([1, 2, 3, 7], [10, 11, 12, 13]) == [(1, 10, 3), (7, 13, 1)]
    assert page_runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]


def test_a_multi_page_write_lands_bit_exact(backend):
    pair = Pair(backend)
    src, dst = [0, 1, 2, 9, 4, 30], [5, 6, 7, 1, 20, 31]     # runs, scatter, reversal
    pair.write(src, dst)
    p_ev, d_ev = pair.settle()
    assert [e.kind for e in p_ev] == [DONE] and [e.kind for e in d_ev] == [LANDED]
    assert (d_ev[0].req_id, d_ev[0].epoch, d_ev[0].peer) == ("r1", 1, pair.P.incarnation)
    want = pool()
    for s, d in zip(src, dst):
        assert torch.equal(pair.D.pool[d], want[s])
    untouched = [i for i in range(PAGES) if i not in dst]
    assert torch.all(pair.D.pool[untouched] == -1)
    m = pair.P.metrics
    assert m.writes == 1 and m.bytes == 6 * pair.P.page_bytes and m.descriptors == 4
    pair.close()


def test_nixl_merges_consecutive_pages_into_one_descriptor_each():
    """Six pages, of which 0-2 -> 5-7 are consecutive on both sides: NIXL
    itself reports moving four descriptors (its telemetry, not our tally)."""
    pair = Pair("nixl")
    pair.write([0, 1, 2, 9, 4, 30], [5, 6, 7, 1, 20, 31])
    p_ev, _ = pair.settle()
    assert [e.kind for e in p_ev] == [DONE]
    assert pair.P.metrics.backend_descriptors == 4
    pair.write([3, 4, 5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5, 6, 7], req="r2")   # one run
    p_ev, _ = pair.settle()
    assert [e.kind for e in p_ev] == [DONE]
    assert pair.P.metrics.backend_descriptors == 4 + 1
    pair.close()


def test_a_single_page_and_a_partial_run(backend):
    pair = Pair(backend)
    pair.write([3], [3], req="a")
    pair.write([10, 11], [0, 1], req="b")
    p_ev, d_ev = pair.settle(2, 2)
    assert sorted(e.req_id for e in d_ev) == ["a", "b"]
    assert torch.equal(pair.D.pool[3], pool()[3]) and torch.equal(pair.D.pool[0:2], pool()[10:12])
    pair.close()


def test_an_injected_post_failure_reports_why_and_writes_nothing(backend):
    pair = Pair(backend, p_faults=FaultInjector([FaultRule("post", "fail", req_id="r1")]))
    pair.write([0, 1], [0, 1])
    p_ev, d_ev = pair.settle(1, 1, seconds=0.3)
    assert [(e.kind, e.reason) for e in p_ev] == [(FAILED, "injected failure at post")]
    assert d_ev == [] and torch.all(pair.D.pool == -1)
    assert pair.P.metrics.failures == 1
    pair.close()


def test_a_completion_failure_is_reported_even_though_the_data_moved(backend):
    pair = Pair(backend, p_faults=FaultInjector([FaultRule("completion", "fail")]))
    pair.write([0], [0])
    p_ev, d_ev = pair.settle()
    assert p_ev[0].kind is FAILED and "completion" in p_ev[0].reason
    assert [e.kind for e in d_ev] == [LANDED]      # D decides what a late landing means
    pair.close()


def test_a_dropped_notification_never_reaches_d(backend):
    pair = Pair(backend, d_faults=FaultInjector([FaultRule("notification", "drop")]))
    pair.write([0], [0])
    p_ev, d_ev = pair.settle(1, 0)                  # the write completed on P ...
    more = pair.settle(0, 1, seconds=0.3)           # ... and D hears nothing of it
    assert [e.kind for e in p_ev] == [DONE] and d_ev + more[1] == []
    pair.close()


def test_a_delayed_notification_arrives_later(backend):
    delay = 0.3
    pair = Pair(backend, d_faults=FaultInjector([FaultRule("notification", "delay",
                                                           delay_s=delay)]))
    t0 = time.monotonic()
    pair.write([0], [0])
    p_ev, d_ev = [], []
    deadline = t0 + 5.0
    while not d_ev and time.monotonic() < deadline:
        p_ev += pair.P.poll()
        d_ev += pair.D.poll()
    landed_after = time.monotonic() - t0
    assert [e.kind for e in d_ev] == [LANDED]
    assert landed_after >= delay                    # held back, not merely slow to poll
    assert pair.D.faults.fired == [("notification", "delay", "r1")]
    assert torch.equal(pair.D.pool[0], pool()[0])
    pair.close()


def test_a_probability_rule_is_seeded_and_reproducible():
    def fired(seed):
        inj = FaultInjector([FaultRule("post", "fail", probability=0.5, times=0)], seed=seed)
        return [inj.match("post", f"r{i}") is not None for i in range(40)]
    assert fired(3) == fired(3) and 5 < sum(fired(3)) < 35


def test_a_restarted_peer_receives_nothing_meant_for_its_previous_incarnation(backend):
    pair = Pair(backend)
    old = pair.D.incarnation
    # Keep the old pool's memory: in one process a new pool could take its
    # address, and a write to the dead incarnation's registration would land
    # in it. A restarted engine is a new process, where that memory is gone.
    old_pool = pair.D.pool
    pair.D.close()
    pair.D = pair.make(Incarnation("decode-0", 2))          # same engine, new start
    pair.D.register_pool(pool(-1.0))
    pair.write([0, 1], [0, 1], target=old)                   # P still thinks of decode-0@1
    p_ev, d_ev = pair.settle(1, 1, seconds=0.3)
    assert [e.kind for e in p_ev] == [FAILED]
    assert d_ev == [] and torch.all(pair.D.pool == -1)
    # once P learns the new incarnation, writes reach it
    pair.P.add_peer(pair.D.incarnation, pair.D.metadata())
    assert pair.P.peers() == [Incarnation("decode-0", 2)]
    pair.write([4], [4], target=pair.D.incarnation)
    p_ev, d_ev = pair.settle()
    assert [e.kind for e in d_ev] == [LANDED] and torch.equal(pair.D.pool[4], pool()[4])
    pair.close()
    del old_pool


def test_mismatched_page_sizes_are_refused_with_the_fix():
    from pdserve.transfer.nixl.transport import NixlTransport

    a, b = NixlTransport(Incarnation("a", 1)), NixlTransport(Incarnation("b", 1))
    a.register_pool(pool())
    b.register_pool(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="same model, dtype and page_size"):
        a.add_peer(b.incarnation, b.metadata())
    a.close()
    b.close()


@pytest.mark.parametrize("backend", ["nixl", "nixl-polled", "loopback"])
def test_one_write_moves_pages_of_every_cache_group(backend):
    """A sliding-window model has one pool per cache group, each with its
    own page bytes: one write names pages of both, by transport page id."""
    pair = Pair(backend)
    full_p, slide_p = pool(), torch.arange(20 * 16, dtype=torch.float32).view(20, 16) + 0.5
    full_d, slide_d = pool(-1.0), torch.full((12, 16), -1.0)
    fabric = LoopbackFabric()
    P, D = pair.make(Incarnation("p2", 1)), pair.make(Incarnation("d2", 1))
    if backend == "loopback":
        P.fabric = D.fabric = fabric
        fabric.endpoints.update({"p2": P, "d2": D})
    P.register_pools([full_p, slide_p])
    D.register_pools([full_d, slide_d])
    P.add_peer(D.incarnation, D.metadata())
    D.add_peer(P.incarnation, P.metadata())
    src = P.page_ids([[3, 4], [17, 18, 19]])
    dst = D.page_ids([[0, 1], [9, 10, 11]])
    assert src == (3, 4, 32 + 17, 32 + 18, 32 + 19) and D.locate(dst[-1]) == (1, 11)
    P.write(KvWrite("r", 1, D.incarnation, src, dst))
    got = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(got) < 2:
        got += P.poll() + D.poll()
    assert sorted(e.kind.value for e in got) == ["done", "landed"]
    assert torch.equal(full_d[0:2], full_p[3:5]) and torch.all(full_d[2:] == -1)
    assert torch.equal(slide_d[9:12], slide_p[17:20]) and torch.all(slide_d[:9] == -1)
    assert P.metrics.bytes == 2 * full_p[0].nbytes + 3 * slide_p[0].nbytes
    P.close()
    D.close()
    pair.close()


# ---- D's fences, P's leases -------------------------------------------------

P0, P1 = Incarnation("prefill-0", 1), Incarnation("prefill-1", 1)


def test_a_fenced_landing_keeps_its_pages_until_the_write_drains():
    t = LandingTable(timeout_s=1.0)
    e1 = t.expect("r", [3, 4], now=0.0, source=P0)
    assert [ld.req_id for ld in t.timed_out(1.5)] == ["r"]
    assert t.fence("r", e1) is not None
    e2 = t.expect("r", [7, 8], now=1.5, source=P0)      # the retry is a new epoch
    assert e2 != e1
    assert t.on_notification("r", e1, P0) is LandingVerdict.DRAINED   # late: its pages may go now
    assert t.on_notification("r", e1, P0) is LandingVerdict.STALE     # and never read as data
    assert t.on_notification("r", e2, P1) is LandingVerdict.STALE     # not the P asked
    assert t.on_notification("r", e2, P0) is LandingVerdict.LANDED


def test_a_quarantined_landing_outlives_every_clock_and_goes_when_its_p_says_the_write_ended():
    """No time frees a fenced landing (P may be frozen with the write
    queued, or the link stalled): only the P incarnation asked, saying no
    write of it is left, or that incarnation being gone."""
    t = LandingTable(timeout_s=1.0)
    e = t.expect("r", [3], now=0.0, source=P0)
    t.fence("r", e)
    assert t.timed_out(1e9) == [] and [ld.pages for ld in t.quarantined()] == [(3,)]
    assert t.ended("r", e, P1) is None                       # another P's word is not its own
    assert t.ended("r", e, Incarnation("prefill-0", 2)) is None
    assert t.ended("r", e, P0).pages == (3,) and len(t) == 0
    e = t.expect("s", [4], now=0.0, source=P0)
    t.fence("s", e)
    t.expect("u", [5], now=0.0, source=Incarnation("prefill-0", 3))
    assert t.sources_gone("prefill-0", before=3)[0].pages == (4,)   # restarted at @3
    assert [ld.req_id for ld in t.sources_gone("prefill-0")] == ["u"]  # removed altogether
    assert len(t) == 0


def test_a_fenced_landing_neither_times_out_again_nor_is_fenced_twice():
    """Once fenced, a landing is past D's timeout: a later pass does not
    report it again (D would recover it, and ack P, on every pass), a
    second fence does not count, and a refusal cannot free it unfenced."""
    t = LandingTable(timeout_s=1.0)
    e = t.expect("r", [3], now=0.0, source=P0)
    assert t.fence("r", e) is not None
    assert t.timed_out(3.0) == []
    assert t.fence("r", e) is None
    assert t.forget("r", e) is False and len(t.quarantined()) == 1


def test_leases_are_renewed_per_peer_and_expire_without_heartbeats():
    leases = LeaseTable(lease_s=10.0)
    d0, d1 = Incarnation("decode-0", 1), Incarnation("decode-1", 1)
    leases.grant("a", d0, now=0.0)
    leases.grant("b", d1, now=0.0)
    assert leases.renew(d0, ["a", "b"], now=8.0) == 1   # b is not d0's to renew
    assert leases.expired(10.0) == ["b"]
    assert leases.expired(17.9) == [] and leases.expired(18.0) == ["a"]
    assert leases.expiries == 2


def test_a_lease_past_its_deadline_is_never_renewed():
    """A heartbeat that arrives after the deadline (it waited out a freeze
    in P's queue, or D was late) renews nothing, even before the expiry
    is swept: D may have given up on that landing already."""
    leases = LeaseTable(lease_s=10.0)
    d0 = Incarnation("decode-0", 1)
    leases.grant("a", d0, now=0.0)
    assert leases.renew(d0, ["a"], now=15.0) == 0
    assert not leases.holds("a", 15.0) and leases.expired(15.0) == ["a"]
    assert leases.renew(d0, ["a"], now=15.0) == 0


def test_a_lease_holds_until_its_deadline_and_not_at_it():
    """`holds` is what P asks before it posts a write: a lease is good
    strictly before its deadline, a renewal moves the deadline, and an id
    never granted or already released holds nothing."""
    leases = LeaseTable(lease_s=10.0)
    d0 = Incarnation("decode-0", 1)
    leases.grant("a", d0, now=0.0)
    leases.grant("b", d0, now=0.0)
    assert leases.holds("a", 9.9) and not leases.holds("a", 10.0)
    leases.renew(d0, ["b"], now=8.0)
    assert leases.holds("b", 17.9) and not leases.holds("b", 18.0)
    leases.release("a")
    assert not leases.holds("a", 0.0) and not leases.holds("never", 0.0)


def test_fault_rules_only_spend_their_count_where_their_action_applies():
    inj = FaultInjector([FaultRule("notification", "fail")])
    assert inj.match("notification", "r", ("delay", "drop")) is None    # fail cannot apply
    assert inj.fired == []
    with pytest.raises(ValueError, match="times"):
        FaultRule("post", "fail", times=-2)


def test_a_late_message_about_an_older_incarnation_does_not_replace_the_live_one():
    fabric = LoopbackFabric()
    p = LoopbackTransport(Incarnation("p", 1), fabric)
    p.add_peer(Incarnation("d", 2), b"d@2")
    p.add_peer(Incarnation("d", 1), b"d@1")
    assert p.peers() == [Incarnation("d", 2)]


def test_a_write_held_back_by_a_delay_is_never_posted_once_cancelled():
    """It is reported CANCELLED (it ended, reading nothing) and never lands."""
    pair = Pair("loopback", p_faults=FaultInjector([FaultRule("post", "delay", delay_s=0.05)]))
    pair.write([0], [0])
    assert pair.P.in_flight("r1")
    pair.P.cancel("r1")
    assert not pair.P.in_flight("r1")
    p_ev, d_ev = pair.settle(2, 1, seconds=0.3)
    assert [e.kind for e in p_ev] == [TransferEventKind.CANCELLED] and d_ev == []
    assert torch.all(pair.D.pool == -1)


@pytest.mark.parametrize("wake", [10_000, None])
def test_a_large_write_lands_while_the_writer_computes(wake):
    """With its progress thread, P's NIXL moves a write while P's loop is
    busy with a round (it does not poll): D sees the landing. Without the
    thread, a write larger than the socket buffers waits for P's next poll.

    The connection is used once first (both sides polling), as it is after
    a pair's first transfer: on a fresh connection about 1 first write in
    80 stayed at P until P polled, thread or no thread (9 of 690 in a loop of
    fresh pairs; none of 1,500 later writes). The engine polls every tick,
    so that costs a first transfer one tick, not the request."""
    from pdserve.transfer.nixl.transport import NixlTransport

    big = torch.arange(8 * 2**20, dtype=torch.float32).view(8, 2**20)      # 8 pages of 4 MiB
    P = NixlTransport(Incarnation("prefill-0", 1), progress_wake_us=wake)
    D = NixlTransport(Incarnation("decode-0", 1), progress_wake_us=wake)
    P.register_pool(big)
    D.register_pool(torch.zeros_like(big))
    P.add_peer(D.incarnation, D.metadata())
    D.add_peer(P.incarnation, P.metadata())
    P.write(KvWrite("r0", 1, D.incarnation, (0,), (0,)))
    events = {DONE: 0, LANDED: 0}
    deadline = time.monotonic() + 10
    while not all(events.values()) and time.monotonic() < deadline:
        for e in P.poll() + D.poll():
            events[e.kind] += 1
    assert events == {DONE: 1, LANDED: 1}
    P.write(KvWrite("r1", 1, D.incarnation, tuple(range(8)), tuple(range(8))))
    landed = []
    deadline = time.monotonic() + (5 if wake else 1)
    while not landed and time.monotonic() < deadline:
        landed += D.poll()                        # P never polls: its loop is "in a round"
    if wake:
        assert [e.kind for e in landed] == [LANDED] and torch.equal(D.pool, big)
    else:
        assert landed == []
        while not landed and time.monotonic() < deadline + 5:
            P.poll()
            landed += D.poll()
        assert [e.kind for e in landed] == [LANDED] and torch.equal(D.pool, big)
    P.close()
    D.close()


def test_a_write_is_in_flight_until_its_end_is_reported(backend):
    """`in_flight` is what P asks before it frees source pages: once the
    write's DONE is reported it is false (loopback: the copy is done at
    the post already)."""
    pair = Pair(backend)
    pair.write([1, 2], [3, 4])
    p_ev, _ = pair.settle()
    assert [e.kind for e in p_ev] == [DONE] and not pair.P.in_flight("r1")
    pair.close()


def test_a_held_loopback_write_reads_the_source_only_when_it_completes():
    """The fake's `hold_writes`: the race a test needs (a write posted, its
    source changed, then read) reproduced in-process."""
    pair = Pair("loopback")
    pair.P.hold_writes, pair.P.can_cancel = True, False
    pair.write([1], [3])
    assert pair.P.in_flight("r1")
    pair.P.cancel("r1")                             # cannot stop it: it runs on
    assert pair.P.in_flight("r1") and pair.settle(1, 1, seconds=0.05) == ([], [])
    pair.P.pool[1] = 7.0
    assert pair.P.complete_held() == 1
    p_ev, d_ev = pair.settle()
    assert [e.kind for e in p_ev] == [DONE] and [e.kind for e in d_ev] == [LANDED]
    assert torch.all(pair.D.pool[3] == 7.0) and not pair.P.in_flight("r1")
