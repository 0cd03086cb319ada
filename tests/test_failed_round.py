"""A round whose forward raises (a CUDA error, say) on a P or D engine: the
requests it computed fail with the error, and the round's peer work still
happens, so nothing waits forever. The engine is an EngineServer without a
model or gRPC: the real planner, peer protocol and loopback transport, an
executor that can be told to raise, and a `send` that records messages."""

import collections
import queue
import threading
import time

import torch

from pdserve.kernels.sampling import SamplingParams
from pdserve.proto import control_pb2 as pb
from pdserve.roles.drain import Drain
from pdserve.roles.engine import Engine
from pdserve.roles.engine_server import EngineServer
from pdserve.roles.engine_stats import EngineCounters
from pdserve.roles.peer_protocol import Peer, PeerProtocol
from pdserve.scheduler import Planner, Request, SamplingLimits
from pdserve.scheduler.grammar import Role
from pdserve.transfer import Incarnation
from pdserve.transfer.loopback import LoopbackFabric, LoopbackTransport
from pdserve.transfer.transport import TransferEvent

from support import config, result_for


class Executor:
    def __init__(self):
        self.tracked, self.fail = {}, None

    def register(self, rid, sp, fallback_seed=0, prompt=(), prior_output=0):
        pass

    def params(self, rid):
        return SamplingParams()

    def prior_output(self, rid):
        return 0

    def forget(self, rid):
        pass

    def on_token(self, req, token, logprob=None):
        return False

    def transfer_lists(self, per_group):
        return per_group

    def run(self, plan):
        if self.fail:
            raise RuntimeError(self.fail)
        return result_for(plan)


class Outputs:
    def __init__(self):
        self.items = []

    def post(self, items):
        self.items += items


def server(role: str, name: str, peer: str) -> EngineServer:
    fabric = LoopbackFabric()
    s = object.__new__(EngineServer)          # no model, no gRPC server, no loop thread
    s.role, s.name, s.incarnation = Role(role), name, 1
    s.executor = Executor()
    s.planner = Planner(config(), s.role)
    s.engine = Engine(name, s.planner, s.executor, forget_finished=False)
    s.transport = LoopbackTransport(Incarnation(name, 1), fabric)
    s.transport.register_pools([torch.zeros(s.planner.cfg.total_pages, 4)])
    s.peer = PeerProtocol(s, s.transport, transfer_timeout_s=30.0, lease_s=10.0,
                          heartbeat_s=2.0)
    s.sent = []
    s.peer.send = lambda to, method, msg, on_error=None: s.sent.append((to, method, msg))
    s.peer.peers[peer] = Peer(peer, 1, "nowhere", None)
    s.transport.add_peer(Incarnation(peer, 1), f"{peer}@1".encode())
    s.drain, s.owner, s.emitted = Drain(name), {}, {}
    s.outputs, s.counts = Outputs(), EngineCounters()
    s.rounds, s._window, s._stalls_logged = collections.deque(), 0, 0
    s._inbox, s._inbox_lock, s._inbox_closed = queue.Queue(), threading.Lock(), False
    s.loop_errors = []
    return s


def one_round(s: EngineServer):
    out = s.engine.step()
    if out is not None:
        s._after_round(out)
    return out


def test_a_failed_round_on_d_still_asks_for_its_remote_admission():
    """D's round holds r1's decode and r2's remote admission, and its forward
    raises: r1 fails with the error, and r2's RemotePrefill still goes out
    with its landing timed, so r2 is never left reserving pages with no
    peer asked and no timeout to end it."""
    d = server("decode", "decode-0", "prefill-0")

    def submit(rid):
        r = Request(rid, list(range(1, 18)), SamplingLimits(max_new_tokens=50))
        r.peer = "prefill-0"
        d.planner.submit(r)
        d.owner[rid] = "router"
    submit("r1")
    one_round(d)
    (_, _, ask), = d.sent
    d.peer.on_transfer_event(TransferEvent("landed", "r1", ask.epoch,
                                           Incarnation("prefill-0", 1), first_token=5))
    d.sent.clear()
    submit("r2")
    d.executor.fail = "CUDA error: an illegal memory access"
    out = one_round(d)
    d.executor.fail = None
    assert [r.id for r in out.failed] == ["r1"]
    assert [op.req.id for op in out.plan.remote_prefills] == ["r2"]
    errors = [(i[0], "CUDA error" in i[4]) for i in d.outputs.items if i[4]]
    assert errors == [("r1", True)]
    assert [(to, m, msg.request_id) for to, m, msg in d.sent] == \
        [("prefill-0", "RemotePrefill", "r2")]
    # P never answers: the landing times out and D prefills r2 itself
    d.peer.timers(time.monotonic() + 31)
    assert "r2" not in d.planner.landing and "r2" in d.planner.requests
    for _ in range(100):
        if not one_round(d):
            break
    d.planner.check_invariants()
    assert "r2" not in d.planner.requests


def test_a_failed_round_on_p_tells_d_and_lets_its_twin_go():
    """P's forward raises while it prefills a twin: the twin fails, D is told
    at once (it prefills the request itself), and P keeps no lease or
    record of it, so P can go idle and a drain can stop."""
    p = server("prefill", "prefill-0", "decode-0")
    p.peer.remote_prefill(pb.RemotePrefillRequest(
        request_id="x", token_ids=list(range(1, 18)), first_page=0,
        landing_pages=list(range(5)), epoch=1, target_engine="decode-0", target_incarnation=1))
    p.executor.fail = "CUDA error"
    out = one_round(p)
    assert [r.id for r in out.failed] == ["x"]
    assert [(to, m, msg.request_id) for to, m, msg in p.sent] == \
        [("decode-0", "TransferFailed", "x")]
    assert not p.peer.remote and len(p.peer.leases) == 0
    assert p._nothing_live()
    p.planner.assert_idle()
