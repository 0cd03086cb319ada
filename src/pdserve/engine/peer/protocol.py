"""The P/D peer protocol of one engine, run on its loop thread.

    D                                        P
    ask_prefill: expect a landing  --RemotePrefill-->  remote_prefill: a twin, a lease
                                                        ... prefill chunks ...
    on_transfer_event(LANDED)  <--NIXL write + notif-- ship
    ack                            --TransferAck----->  transfer_ack: release the pins
    heartbeats while waiting       --LeaseHeartbeat-->  renew the leases
    recover locally              <--TransferFailed---  the write failed (FAILED)
    give up: quarantine the pages  --TransferAck (release) / LeaseHeartbeat (fenced)-->
    free them                    <--TransferEnded----  no write of it is left

Safety: D never reuses landing pages a write might still reach. A landing D
gives up on (a timeout, an abort, an unreachable P) is quarantined
(transfer/landing.py) until its notification arrives, P reports that no
write of it is in flight or will be posted (TransferEnded), or that P
incarnation is known gone; no clock frees it. P, told D gave up on a
landing, raises its ask floor for that D (a RemotePrefill at or below it is
refused, however late it comes) and cancels the twin, and reports the end
once its transport says no write of it runs. P posts no write once its
lease ran out (an expired lease is never renewed), and never frees a source
page a posted write may still read (`draining`). Every message names its
sender's incarnation; one from an incarnation older than the one known for
that peer is ignored and counted (`stale_messages`). A RemotePrefill that
P refuses (it drains) or that cannot reach P is recovered at once by a
local prefill on D. Messages go out on a queue per peer (messages.py),
never blocking the loop, and a hung peer delays no other.

The protocol is given the parts of the engine it works on (its planner,
executor, counters and drain), not the engine server itself.
"""

from __future__ import annotations

from pdserve.engine.peer.base import PeerBase, Release
from pdserve.engine.peer.decode_side import DecodeSide
from pdserve.engine.peer.prefill_side import PrefillSide
from pdserve.engine.spec.speculation import check_peer_spec
from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg
from pdserve.proto.control_tls import channel
from pdserve.engine.peer.messages import Peer
from pdserve.scheduler.planner import RejectedRequest
from pdserve.scheduler.round.grammar import Role
from pdserve.transfer import Incarnation, TransferEventKind
from pdserve.transfer.timeouts import PeerTimeouts

__all__ = ["PeerBase", "PeerProtocol", "PeerTimeouts", "Release"]


class PeerProtocol(DecodeSide, PrefillSide):
    """One engine's side of the protocol: D's half or P's, by its role."""

    def add_peer(self, r: pb.AddPeerRequest) -> None:
        """Know a peer (its address, and its NIXL agent's metadata: the only
        way an engine learns one, over the control plane's mutual TLS). The
        metadata is loaded first: if the transport refuses it, nothing of
        the peer is kept (RejectedRequest)."""
        check_peer_spec(self.name, self.planner.cfg, r)
        old = self.peers.get(r.engine)
        if old is not None and old.incarnation == r.incarnation:
            return
        if old is not None and old.incarnation > r.incarnation:
            raise RejectedRequest(f"{self.name} knows {r.engine} at incarnation "
                                  f"{old.incarnation}, newer than {r.incarnation}")
        if self.transport is not None:
            if not r.nixl_metadata:
                raise RejectedRequest(f"AddPeer for {r.engine} carries no NIXL metadata: "
                                      f"{self.name} could not exchange KV with it")
            try:
                self.transport.add_peer(Incarnation(r.engine, r.incarnation), r.nixl_metadata)
            except Exception as e:      # the backend's own errors too: any means refused
                raise RejectedRequest(f"{r.engine}'s NIXL metadata is not usable: "
                                      f"{type(e).__name__}: {e}") from None
        ch = channel(r.address, self.control_tls)
        self.peers[r.engine] = Peer(r.engine, r.incarnation, r.address,
                                    pbg.EngineControlStub(ch))
        self.breaker.close(r.engine)          # a new incarnation starts with a clean record
        if old is not None:
            self.peer_gone(r.engine, before=r.incarnation)

    def remove_peer(self, r: pb.RemovePeerRequest) -> None:
        """The router says Ray reports peer `r.engine` dead or restarting:
        its incarnations up to `r.incarnation` write nothing more. On D,
        the landings asked of them come back now (the only other way back
        for a quarantined one is that P's own TransferEnded, which a dead
        P never sends). On P nothing waits on a D: its pins go when their
        leases run out. The peer stays known; a newer incarnation's
        AddPeer replaces it."""
        if self.role is Role.DECODE:
            self.peer_gone(r.engine, before=r.incarnation + 1)

    def on_transfer_event(self, ev) -> None:
        if ev.kind is TransferEventKind.LANDED:
            self.landed(ev)
        else:
            self.write_ended(ev)

    def timers(self, now: float) -> None:
        if self.role is Role.DECODE:
            self.decode_timers(now)
        elif self.role is Role.PREFILL:
            self.prefill_timers(now)
