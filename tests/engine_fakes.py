"""An EngineServer without a model, gRPC or loop thread, for tests of its
round glue: the real planner, peer protocol and loopback transport, an
executor that can be told to raise, outputs that record what was posted,
and a `send` that records messages. Jobs posted to the loop thread wait in
its inbox (`run_jobs`)."""

import collections
import queue
import threading

import torch

from pdserve.kernels.sampling import SamplingParams
from pdserve.roles.drain import Drain
from pdserve.roles.engine import Engine
from pdserve.roles.engine_server import EngineServer
from pdserve.roles.engine_stats import EngineCounters
from pdserve.roles.peer_protocol import Peer, PeerProtocol
from pdserve.scheduler import Planner
from pdserve.scheduler.grammar import Role
from pdserve.transfer import Incarnation
from pdserve.transfer.loopback import LoopbackFabric, LoopbackTransport

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
        self.items, self.opened = [], []

    def post(self, items):
        self.items += items

    def open(self, req_id, subscriber, prompt, sp=None, key=None, prior=(0, 0)):
        self.opened.append((req_id, key))

    def has(self, subscriber):
        return True


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




def run_jobs(s: EngineServer) -> None:
    """What the loop thread runs between rounds: every job posted so far."""
    while not s._inbox.empty():
        s._inbox.get_nowait()()
