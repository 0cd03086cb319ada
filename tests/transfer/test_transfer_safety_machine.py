"""The transfer path's safety rules under any schedule (issue 53): a state
machine over one D and one P (either restarted at will, a new incarnation
each time) whose every message, write and notification the test holds and
hands over in any order, late or never before the end; time moves by
hand, and either side may be frozen (runs no pass) for as long as it
likes. The rules under test are the lease (P posts only under it; an
expired one never renews), the quarantine (D keeps a landing it gave up on
until P says no write of it is left, or P's incarnation is gone), P's ask
floor, the jobs that carry their caller's deadline, and incarnations.

The properties:
- no write ever lands in a page not held for it: when a write completes,
  D still expects it (its landing is live, with exactly those pages, from
  that P incarnation) or holds its pages quarantined for it;
- every page comes back: once everything is delivered (and each side
  knows the other's latest incarnation), both engines end idle, nothing
  quarantined.

Messages are the engines' own (each engine's PeerSender is replaced by the
network here); a message's caller gives up `RPC_TIMEOUT_S` after sending it
(its on_error hears DEADLINE_EXCEEDED), and the receiver's handler queues
its work with that deadline, as EngineServer.call does."""

import dataclasses
from typing import Callable

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule)

from pdserve.engine.peer.messages import RPC_TIMEOUT_S, PeerRpc
from pdserve.proto import control_pb2 as pb
from pdserve.scheduler import Request, SamplingLimits
from pdserve.scheduler.planner import RejectedRequest
from pdserve.transfer import FaultRule
from pdserve.transfer.loopback import LoopbackFabric

from support.engine_fakes import handler, one_round, server

P, D = "prefill-0", "decode-0"
MAX_REQUESTS, MAX_RESTARTS = 6, 2


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Message:
    dst: str
    rpc: PeerRpc
    msg: object
    on_error: Callable | None
    deadline: float
    answered: bool = False          # its caller heard: done, refused, or gave up


class Network:
    """An engine's PeerSender: what it sends waits in the machine's network."""

    def __init__(self, machine: "TransferSafety"):
        self.machine = machine

    def send(self, peer, rpc, request, on_error=None, delay_s=0.0):
        m = Message(peer.name, rpc, request, on_error, self.machine.clock.now + RPC_TIMEOUT_S)
        self.machine.in_flight.append(m)
        self.machine.calls.append(m)

    def close(self, wait=False):
        pass


def answer(m: Message, code=None) -> None:
    """The caller of `m` hears back (once): `code`, or success (None)."""
    if m.answered:
        return
    m.answered = True
    if code is not None and m.on_error is not None:
        m.on_error(code)


class TransferSafety(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.fabric = LoopbackFabric()
        self.in_flight: list[Message] = []
        self.calls: list[Message] = []
        self.frozen = {P: False, D: False}
        self.violations: list[str] = []
        self.p_inc, self.d_inc, self.submitted, self.writes = 1, 1, 0, 0
        self.d = self.engine("decode", D, P, 1, 1)
        self.p = self.new_p()

    # ---- the engines -------------------------------------------------------------
    def engine(self, role, name, peer, inc, peer_inc):
        s = server(role, name, peer, self.fabric, incarnation=inc, peer_incarnation=peer_inc)
        s.peer.sender = Network(self)
        for part in (s.peer, s.inbox, s.loop):
            part.clock = self.clock
        return s

    def new_p(self):
        p = self.engine("prefill", P, D, self.p_inc, self.d_inc)
        p.transport.hold_writes = True          # a write lands when the machine says so
        p.transport.can_cancel = False          # and, as over NIXL, cannot be recalled
        return p

    def by_name(self, name):
        return self.p if name == P else self.d

    def run_pass(self, s) -> None:
        """A pass of `s`'s loop, in its order: transfer events and timers,
        then its queue, then rounds."""
        for ev in s.transport.poll():
            s.peer.on_transfer_event(ev)
        s.peer.timers(self.clock.now)
        s.inbox.run_pending()
        for _ in range(3):
            one_round(s)

    def deliver(self, m: Message) -> None:
        """`m` reaches its engine's handler, which queues its work with
        the caller's deadline (dropped, the caller told, once it passed)."""
        dst = self.by_name(m.dst)

        def job():
            try:
                handler(dst, m.rpc)(m.msg)
            except RejectedRequest:
                answer(m, grpc.StatusCode.INVALID_ARGUMENT)
            else:
                answer(m)
        dst.inbox.post(job, m.deadline, lambda: answer(m, grpc.StatusCode.DEADLINE_EXCEEDED))

    def land(self, w) -> None:
        """P's write `w` completes now: it must reach only pages D holds for it."""
        self.writes += 1
        d = self.d
        if w.target == d.transport.incarnation:     # else it goes nowhere: the loopback fails it
            ld = d.peer.landing.get(w.req_id, w.epoch)
            held = ld is not None and ld.pages == tuple(w.dst_pages) and \
                ld.source == w.source and (
                    (w.req_id, w.epoch) in d.planner.coord.fences if ld.fenced
                    else w.req_id in d.planner.landing)
            if not held:
                self.violations.append(f"{w.source} wrote {w.req_id}@{w.epoch} into pages "
                                       f"{sorted(w.dst_pages)} D no longer held for it")
        self.p.transport.complete_held(w.req_id)

    def expire_calls(self) -> None:
        for m in self.calls:
            if not m.answered and m.deadline <= self.clock.now:
                answer(m, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.calls = [m for m in self.calls if not m.answered]

    # ---- the rules ---------------------------------------------------------------
    # An engine that is not frozen runs a pass after every step (its loop
    # runs on its own); a frozen one runs none until it thaws, while its
    # handlers keep queuing what reaches it.
    def engines_run(self) -> None:
        for side in (P, D):
            if not self.frozen[side]:
                self.run_pass(self.by_name(side))

    @initialize(n=st.integers(1, 3))
    def asked(self, n):
        """D holds `n` requests and has asked P for them (the asks in flight)."""
        for _ in range(n):
            self.submit()

    @precondition(lambda self: self.submitted < MAX_REQUESTS)
    @rule()
    def submit(self):
        rid = f"r{self.submitted}"
        self.submitted += 1
        r = Request(rid, list(range(1, 18)), SamplingLimits(max_new_tokens=2))
        r.peer = P
        self.d.planner.submit(r)
        self.d.owner[rid] = "router"
        self.engines_run()

    @rule(data=st.data())
    def abort_on_d(self, data):
        live = sorted(self.d.planner.requests)
        if live:
            self.d.abort(data.draw(st.sampled_from(live)), "client left")
        self.engines_run()

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def deliver_one(self, data):
        """Any message in flight, in any order."""
        i = data.draw(st.integers(0, len(self.in_flight) - 1))
        self.deliver(self.in_flight.pop(i))
        self.engines_run()

    @precondition(lambda self: self.p.transport.held())
    @rule(data=st.data())
    def complete_a_write(self, data):
        """A held write (a stalled link) completes, whenever."""
        held = self.p.transport.held()
        self.land(held[data.draw(st.integers(0, len(held) - 1))])
        self.engines_run()

    @rule()
    def lose_a_notification(self):
        """D never hears of the next write that lands."""
        self.d.transport.faults.add(FaultRule("notification", "drop"))

    @rule(side=st.sampled_from([P, D]))
    def freeze_or_thaw(self, side):
        self.frozen[side] = not self.frozen[side]
        self.engines_run()

    @rule(dt=st.sampled_from([1.0, 5.0, 12.0, 35.0, 50.0]))
    def time_passes(self, dt):
        """`dt` seconds, in steps of at most a heartbeat; the engines that
        are not frozen run between steps."""
        end = self.clock.now + dt
        while self.clock.now < end:
            self.clock.now = min(end, self.clock.now + 2.0)
            self.expire_calls()
            self.engines_run()

    @precondition(lambda self: self.p_inc <= MAX_RESTARTS)
    @rule()
    def restart_p(self):
        """P's process is gone (its held writes with it) and Ray starts
        prefill-0 afresh at a new incarnation; the router introduces D to
        it at once, and it to D later (`introduce`)."""
        self.p_inc += 1
        self.p = self.new_p()
        self.frozen[P] = False
        self.engines_run()

    @precondition(lambda self: self.d.peer.peers[P].incarnation < self.p_inc)
    @rule()
    def introduce(self):
        """The router introduces the restarted P to D."""
        self.d.peer.add_peer(pb.AddPeerRequest(engine=P, incarnation=self.p_inc,
                                               address="nowhere:0",
                                               nixl_metadata=f"{P}@{self.p_inc}".encode()))
        self.engines_run()

    @precondition(lambda self: self.d_inc <= MAX_RESTARTS)
    @rule()
    def restart_d(self):
        """D's process is gone (its requests, pages and landings with it) and
        Ray starts decode-0 afresh at a new incarnation, which the router
        introduces to the P it knows at once, and D to P later."""
        self.d_inc += 1
        self.d = self.engine("decode", D, P, self.d_inc, self.p_inc)
        self.frozen[D] = False
        self.engines_run()

    @precondition(lambda self: self.p.peer.peers[D].incarnation < self.d_inc)
    @rule()
    def introduce_d(self):
        """The router introduces the restarted D to P."""
        self.p.peer.add_peer(pb.AddPeerRequest(engine=D, incarnation=self.d_inc,
                                               address="nowhere:0",
                                               nixl_metadata=f"{D}@{self.d_inc}".encode()))
        self.engines_run()

    # ---- the properties ------------------------------------------------------------
    @invariant()
    def no_write_reached_a_page_not_held_for_it(self):
        assert not self.violations, self.violations

    @invariant()
    def the_planners_hold(self):
        self.d.planner.check_invariants()
        self.p.planner.check_invariants()

    def teardown(self):
        """Everything delivered, every held write completed, the restarted
        P introduced, time run on: every page comes back."""
        self.frozen = {P: False, D: False}
        if self.d.peer.peers[P].incarnation < self.p_inc:
            self.introduce()
        if self.p.peer.peers[D].incarnation < self.d_inc:
            self.introduce_d()
        for _ in range(100):
            while self.in_flight:
                self.deliver(self.in_flight.pop(0))
            for w in self.p.transport.held():
                self.land(w)
            self.run_pass(self.p)
            self.run_pass(self.d)
            if self.settled():
                break
            self.clock.now += 2.0
            self.expire_calls()
        assert not self.violations, self.violations
        assert self.settled(), self.describe()
        self.d.planner.assert_idle()
        self.p.planner.assert_idle()

    def settled(self) -> bool:
        d, p = self.d, self.p
        return (not self.in_flight and not p.transport.held() and not d.planner.requests
                and not p.planner.requests and not d.peer.quarantined()
                and len(d.peer.landing) == 0 and p.peer.idle() and d.peer.idle())

    def describe(self) -> str:
        d, p = self.d, self.p
        return (f"in flight {[(m.dst, m.rpc.value) for m in self.in_flight]}, held "
                f"{[w.req_id for w in p.transport.held()]}, D requests "
                f"{sorted(d.planner.requests)}, P requests {sorted(p.planner.requests)}, "
                f"quarantined {[(ld.req_id, ld.epoch) for ld in d.peer.quarantined()]}, "
                f"P remote {sorted(p.peer.remote)} draining {sorted(p.peer.draining)}")


TransferSafety.TestCase.settings = settings(
    max_examples=600, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_no_write_reaches_a_page_not_held_for_it_and_every_page_comes_back = TransferSafety.TestCase
