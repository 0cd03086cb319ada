"""An EngineServer without a model, gRPC or loop thread, for tests of its
round glue: the real planner, peer protocol and loopback transport, an
executor that can be told to raise, outputs that record what was posted,
and a peer sender that records the messages it was given (`sent`). Jobs
posted to the loop thread wait in its inbox (`run_jobs`)."""

from types import SimpleNamespace

import torch

from pdserve.text.sampling_params import SamplingParams
from pdserve.proto import control_pb2 as pb
from pdserve.engine.peer.messages import PeerRpc
from pdserve.engine.server import EngineServer
from pdserve.scheduler import Planner
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer import Incarnation
from pdserve.transfer.loopback import LoopbackFabric, LoopbackTransport

from support.planner import config, result_for


class Executor:
    # what EngineServer.info() reads of a model
    model = SimpleNamespace(dtype=torch.float32, attention=SimpleNamespace(name="torch"))
    adapters = None                    # serves the base model only

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
    busy_since = None                  # never on a batch: what the watchdog reads

    def __init__(self):
        self.items, self.opened = [], []
        self.subscribers: dict = {}

    def subscribe(self, subscriber):
        import queue

        q = self.subscribers[subscriber] = queue.Queue()
        return q

    def unsubscribe(self, subscriber, q) -> bool:
        if self.subscribers.get(subscriber) is q:
            del self.subscribers[subscriber]
            return True
        return False

    def post(self, items):
        self.items += items

    def open(self, req_id, subscriber, prompt, sp=None, key=None, prior=(0, 0)):
        self.opened.append((req_id, key))

    def has(self, subscriber):
        return True

    def close(self):
        pass


class Sender:
    """Records (peer, rpc, message) at once, on the calling thread (and
    each message's on_error, for `deliver`)."""

    def __init__(self):
        self.sent = []
        self.on_error = []
        self.delivered: set[int] = set()  # which of `sent` deliver() has handed on

    def send(self, peer, rpc, request, on_error=None, delay_s=0.0):
        self.sent.append((peer.name, rpc, request))
        self.on_error.append(on_error)

    def close(self, wait=False):
        pass


def server(role: str, name: str, peer: str, fabric: LoopbackFabric | None = None,
           incarnation: int = 1, peer_incarnation: int = 1, **options) -> EngineServer:
    """Engine `name` of `role` at `incarnation`, knowing `peer` at
    `peer_incarnation` (its gRPC stub never called: what it is sent lands
    in `sent(server)`). Two servers given one `fabric` reach each other's
    pools: a write from one lands in the other. `options` go to
    EngineServer (control_tls, vocab_size)."""
    planner = Planner(config(), Role(role))
    transport = LoopbackTransport(Incarnation(name, incarnation), fabric or LoopbackFabric())
    transport.register_pools([torch.zeros(planner.cfg.total_pages, 4)])
    s = EngineServer(Role(role), name, planner, Executor(), lambda on_stop: Outputs(),
                     transport, incarnation=incarnation, sender=Sender(), **options)
    s.peer.add_peer(pb.AddPeerRequest(engine=peer, incarnation=peer_incarnation,
                                      address="nowhere:0",
                                      nixl_metadata=f"{peer}@{peer_incarnation}".encode()))
    return s


def ack(req_id: str, epoch: int, engine: str = "decode-0", release_only: bool = False,
        incarnation: int = 1) -> pb.TransferAckRequest:
    """D's TransferAck as D sends it (its name and incarnation)."""
    return pb.TransferAckRequest(request_id=req_id, release_only=release_only, engine=engine,
                                 epoch=epoch, incarnation=incarnation)


def sent(s: EngineServer) -> list:
    """What `s` sent its peers: (peer, PeerRpc, message), oldest first."""
    return s.peer.sender.sent


def one_round(s: EngineServer):
    out = s.engine.step()
    if out is not None:
        s.loop.after_round(out)
    return out


def remote_prefill_asked(d: EngineServer, req_id: str = "x"):
    """A 17-token request for `d` (a D engine whose peer is prefill-0) put
    through its first round: the RemotePrefill it sent P, returned."""
    r = Request(req_id, list(range(1, 18)), SamplingLimits(max_new_tokens=3))
    r.peer = "prefill-0"
    d.planner.submit(r)
    d.owner[req_id] = "router"
    one_round(d)
    (_, method, ask), = sent(d)
    assert method is PeerRpc.REMOTE_PREFILL
    return ask


def handler(to: EngineServer, rpc: PeerRpc):
    """What `to`'s RPC handler runs for a peer message of kind `rpc`."""
    return {PeerRpc.REMOTE_PREFILL: to.peer.remote_prefill,
            PeerRpc.TRANSFER_ACK: to.peer.transfer_ack,
            PeerRpc.TRANSFER_FAILED: to.peer.transfer_failed_from_peer,
            PeerRpc.LEASE_HEARTBEAT: to.peer.heartbeat,
            PeerRpc.TRANSFER_ENDED: to.peer.transfer_ended_from_peer}[rpc]


def deliver(frm: EngineServer, to: EngineServer) -> int:
    """Hand `to` what `frm` sent it since the last delivery, in order, as
    its handlers would run them on its loop thread (a refusal goes back to
    the message's on_error as INVALID_ARGUMENT, as gRPC would carry it).
    Messages to other peers are passed over. Returns how many it handed."""
    import grpc

    from pdserve.scheduler.planner import RejectedRequest

    snd = frm.peer.sender
    n, i = 0, 0
    while i < len(snd.sent):
        (name, rpc, msg), on_error = snd.sent[i], snd.on_error[i]
        i += 1
        if name != to.name or i - 1 in snd.delivered:
            continue
        snd.delivered.add(i - 1)
        n += 1
        try:
            handler(to, rpc)(msg)
        except RejectedRequest:
            if on_error is not None:
                on_error(grpc.StatusCode.INVALID_ARGUMENT)
    return n


def run_jobs(s: EngineServer) -> None:
    """What the loop thread runs between rounds: every job posted so far."""
    s.inbox.run_pending()


class Refused(Exception):
    """A handler ended its call with a status (`RpcContext.abort`)."""


class RpcContext:
    """What a handler uses of grpc's ServicerContext; `abort` raises, as
    grpc's does."""

    def __init__(self):
        self.code = None

    def abort(self, code, details):
        self.code = code
        raise Refused(f"{code}: {details}")

    def time_remaining(self):
        return 0.0

    def add_callback(self, fn):
        return False                     # the call already ended: the handler cleans up


def rpc(servicer, method: str, msg):
    """Call EngineControl handler `method` as gRPC would; the status code it
    ended the call with, or None (OK)."""
    ctx = RpcContext()
    try:
        out = getattr(servicer, method)(msg, ctx)
        if method == "Subscribe":
            list(out)
    except Refused:
        pass
    return ctx.code


# ---- a P and D pair on one fabric (the frozen-peer and breaker tests) ----------------

LEASE_S, TRANSFER_S, HEARTBEAT_S = 10.0, 30.0, 2.0       # PeerTimeouts' defaults
OLD_FENCE_S = LEASE_S + HEARTBEAT_S + TRANSFER_S          # when D used to free the pages


def pair():
    """P and D on one fabric. P's page i holds i + 1; D's pool holds -1,
    so any page a write reaches shows."""
    fabric = LoopbackFabric()
    p = server("prefill", "prefill-0", "decode-0", fabric)
    d = server("decode", "decode-0", "prefill-0", fabric)
    p.transport.pool.copy_(torch.arange(1, p.transport.pool.shape[0] + 1, dtype=torch.float32)
                           .unsqueeze(1).expand_as(p.transport.pool))
    d.transport.pool.fill_(-1.0)
    return p, d


def fenced_pages(s) -> set[int]:
    """The pages D's fences hold (what no one else may be given)."""
    return {pg for groups in s.planner.coord.fences.values() for pg in groups[0]}


def submit_for_prefill(d, rid: str) -> None:
    """Submit `rid` (17 tokens, 3 new) to D, paired with prefill-0."""
    r = Request(rid, list(range(1, 18)), SamplingLimits(max_new_tokens=3))
    r.peer = "prefill-0"
    d.planner.submit(r)
    d.owner[rid] = "router"


def asked(d, rid: str) -> int:
    """Submit `rid` to D for prefill-0; run rounds until D asked for it: its
    landing's epoch."""
    submit_for_prefill(d, rid)
    for _ in range(20):
        one_round(d)
        if rid in d.peer.epochs:
            return d.peer.epochs[rid]
    raise AssertionError(f"D never asked for {rid}")


def finish(s, rounds: int = 100) -> None:
    for _ in range(rounds):
        if one_round(s) is None and not s.planner.requests:
            return
