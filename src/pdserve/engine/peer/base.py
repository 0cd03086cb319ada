"""What both halves of the peer protocol (decode_side.py, prefill_side.py)
share: the parts of the engine they work on (its planner, executor,
counters, drain and transport), their tables (D's landings, P's leases,
twins and ask floor), the peers known (at which incarnation, and whether a
message's sender is the one known), and how a message leaves (the peer
sender's queue for that peer, never the loop thread)."""

from __future__ import annotations

import enum
import logging
import time
from typing import Callable

from pdserve.engine.drain import Drain
from pdserve.engine.peer.messages import Peer, PeerRpc, PeerSender
from pdserve.engine.stats import EngineCounters
from pdserve.proto.control_tls import ControlTls
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.round.grammar import Role
from pdserve.transfer import Incarnation, LandingTable, LeaseTable
from pdserve.engine.peer.breaker import PrefillBreaker
from pdserve.transfer.timeouts import PeerTimeouts

log = logging.getLogger("pdserve.engine")


class Release(enum.Enum):
    """Why P lets a twin go, once no write of it reads its pages."""
    ACKED = "acked"             # D acknowledged (it has the KV, or wants it no more)
    EXPIRED = "expired"         # the lease ran out: D said nothing for lease_s
    ABORTED = "aborted"         # P aborted it (a drain's deadline)


class PeerBase:
    def __init__(self, me: Incarnation, role: Role, planner: Planner, executor,
                 counts: EngineCounters, drain: Drain, transport, sender: PeerSender,
                 timeouts: PeerTimeouts, post_job: Callable, delivered: Callable,
                 control_tls: ControlTls | None = None):
        """`transport`: the engine's KvTransport (None on a fused engine);
        `post_job(fn)` runs fn on the loop thread (from an RPC's thread);
        `delivered(req, finished)` hands a landed request's first token to
        its stream (`finished`: the requests that ended with it);
        `control_tls`: this engine's credentials for its peers' ports."""
        self.me = me
        self.control_tls = control_tls
        self.role = role
        self.planner = planner
        self.executor = executor
        self.counts = counts
        self.drain = drain
        self.transport = transport
        self.sender = sender
        self.post_job = post_job
        self.delivered = delivered
        timeouts.check()
        self.landing = LandingTable(timeouts.transfer_s)                       # D
        self.breaker = PrefillBreaker(timeouts.transfer_s, 2 * timeouts.transfer_s)  # D
        self.leases = LeaseTable(timeouts.lease_s)                            # P
        self.heartbeat_s = timeouts.heartbeat_s
        # what the protocol stamps and checks its deadlines by (the loop passes
        # timers() its own reading): a test moves it past a lease mid-round
        self.clock: Callable[[], float] = time.monotonic
        self.peers: dict[str, Peer] = {}
        self.remote: dict[str, tuple] = {}      # P: req -> (D name, incarnation, pages, epoch)
        self.epochs: dict[str, int] = {}        # D: req -> landing epoch
        # P: twins let go while a write of theirs may still read their pages:
        # pinned until the transport says the write ended, then released so
        self.draining: dict[str, Release] = {}
        # P: per D engine, (its incarnation, the highest landing epoch it gave
        # up on): a RemotePrefill at or below it is refused, so that once P
        # reported a landing ended, no late ask can start a write into it
        self.ask_floor: dict[str, tuple[int, int]] = {}
        # P: twins D gave up on whose write may still run: the report owed to
        # D once it ended, (D name, epoch)
        self.end_owed: dict[str, tuple[str, int]] = {}
        self._last_heartbeat = 0.0

    @property
    def name(self) -> str:
        return self.me.engine_id

    def idle(self) -> bool:
        """No lease held for a peer, no write owed to one, none draining."""
        return len(self.leases) == 0 and not self.remote and not self.draining

    def quarantined(self) -> list:
        """D: the landings given up on whose pages stay held (transfer/landing.py)."""
        return self.landing.quarantined()

    def current(self, engine: str, incarnation: int) -> bool:
        """Is a message from `engine` at `incarnation` from the incarnation
        known for it? One from an older incarnation (a process that outlived
        its restart, or a message that waited out one) is counted in
        `stale_messages`; one from a newer one than known (membership has
        not introduced it yet) is not stale, but not current either."""
        known = self.peers.get(engine)
        if known is None:
            return False
        if incarnation < known.incarnation:
            self.counts.stale_messages += 1
            log.info("%s: ignored a message from %s@%d (knows @%d)", self.name, engine,
                     incarnation, known.incarnation)
            return False
        return incarnation == known.incarnation

    def close(self, wait: bool = False) -> None:
        """Stop sending; with `wait`, messages already queued go out first
        (each bounded by its RPC timeout)."""
        self.sender.close(wait=wait)
        if self.transport is not None:
            self.transport.close()

    def send(self, peer_name: str | None, rpc: PeerRpc, request, on_error=None) -> None:
        """Fire a control message to a peer off the loop thread; a failed
        call's status code goes to `on_error` (on the sending thread). An
        "ack" fault rule can drop or delay a TransferAck (chaos tests)."""
        peer = self.peers.get(peer_name) if peer_name is not None else None
        if peer is None:
            log.warning("%s: no peer %s for %s", self.name, peer_name, rpc.value)
            return
        delay = 0.0
        if rpc is PeerRpc.TRANSFER_ACK and self.transport is not None:
            rule = self.transport.faults.match("ack", request.request_id)
            if rule is not None and rule.action in ("drop", "fail"):
                return
            if rule is not None and rule.action == "delay":
                delay = rule.delay_s
        self.sender.send(peer, rpc, request, on_error, delay)
