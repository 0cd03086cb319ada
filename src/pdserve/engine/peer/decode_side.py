"""D's half of the peer protocol: asking P for a prompt's KV, the landing
it reserves, what comes back (the write's notification, P's TransferFailed
and TransferEnded), giving a landing up (a timeout, an abort, a P that
refused, could not be reached or did not answer) into quarantine, and the
heartbeats that renew P's leases and name the quarantined landings."""

from __future__ import annotations

import grpc

from pdserve.engine.lora.adapters import name_of
from pdserve.engine.peer.base import PeerBase
from pdserve.engine.peer.messages import PeerRpc
from pdserve.proto import control_pb2 as pb
from pdserve.proto import router_pb2 as rpb
from pdserve.proto.sampling import to_options
from pdserve.text.sampling_params import Logprob
from pdserve.transfer import Incarnation, LandingVerdict


class DecodeSide(PeerBase):
    def ask_prefill(self, op) -> None:
        req = op.req
        if req.peer is None or req.peer not in self.peers:
            self.recover_locally(req.id, 0, "no prefill peer", fence=False, stage="no_peer")
            return
        if not self.breaker.allows(req.peer, self.clock()):
            self.recover_locally(req.id, 0, f"prefill engine {req.peer}'s transfers keep "
                                 "failing", fence=False, stage="prefill_breaker_open")
            return
        # every group's pages (a state slot as its two rows), one list
        landing = self.transport.page_ids(self.executor.transfer_lists(op.landing))
        source = Incarnation(req.peer, self.peers[req.peer].incarnation)
        epoch = self.landing.expect(req.id, landing, self.clock(), source)
        self.epochs[req.id] = epoch
        sp, prior = self.executor.params(req.id), self.executor.prior_output(req.id)
        peer = req.peer

        def failed(code) -> None:                          # the RPC's thread
            self.post_job(lambda: self._prefill_not_taken(req.id, epoch, peer, code))
        self.send(req.peer, PeerRpc.REMOTE_PREFILL, pb.RemotePrefillRequest(
            request_id=req.id, token_ids=req.prompt.tokens, first_page=op.first_page,
            landing_pages=landing, epoch=epoch, target_engine=self.name,
            target_incarnation=self.me.epoch, sampling=to_options(sp, max_tokens=1),
            prior_output=prior, adapter=name_of(self.executor.adapters, req.adapter),
            adapter_id=req.adapter, prefill_incarnation=source.epoch), on_error=failed)

    def _prefill_not_taken(self, req_id: str, epoch: int, peer: str, code) -> None:
        """P refused the RemotePrefill (it drains, or it still holds an
        earlier copy of the id), it was never sent (the queue to P was
        full), or P could not be reached or did not answer in time: prefill
        locally now rather than wait out the landing timeout. A refusal or
        an ask never sent posted nothing; an unreachable or silent P might
        still have taken it, so those pages are quarantined (P reports the
        end once told, and refuses the ask from then on)."""
        if self.epochs.get(req_id) != epoch:
            return                                         # that landing already ended
        refused = {grpc.StatusCode.FAILED_PRECONDITION: ("is draining", "prefill_draining"),
                   grpc.StatusCode.INVALID_ARGUMENT: ("refused it", "prefill_refused"),
                   grpc.StatusCode.RESOURCE_EXHAUSTED: ("was not asked (its queue is full)",
                                                        "prefill_not_asked")}
        lost = {grpc.StatusCode.UNAVAILABLE: ("is unreachable", "prefill_unreachable"),
                grpc.StatusCode.DEADLINE_EXCEEDED: ("did not answer", "prefill_silent")}
        if code in refused:
            why, stage = refused[code]
            if self.landing.forget(req_id, epoch):
                self.recover_locally(req_id, epoch, f"prefill engine {peer} {why}",
                                     fence=False, stage=stage)
        elif code in lost:
            why, stage = lost[code]
            self.breaker.failed(peer, self.clock())
            self.recover_locally(req_id, epoch, f"prefill engine {peer} {why}",
                                 fence=True, stage=stage)

    def _ack(self, req_id: str, epoch: int, release_only: bool = False):
        return pb.TransferAckRequest(request_id=req_id, release_only=release_only,
                                     engine=self.name, epoch=epoch, incarnation=self.me.epoch)

    def recover_locally(self, req_id: str, epoch: int, reason: str, fence: bool,
                        stage: str) -> None:
        if req_id not in self.planner.landing:
            return
        key = None
        if fence:
            self.counts.fences += self.landing.fence(req_id, epoch) is not None
            key = (req_id, epoch)
        self.epochs.pop(req_id, None)
        self.counts.transfer_failed(stage)
        self.planner.transfer_failed(req_id, reason, fence_key=key)

    def abort_landing(self, req, reason: str) -> None:
        """D aborts a request whose landing is outstanding: a posted write
        may still land, so fence the pages, then let go and tell P."""
        epoch = self.epochs.pop(req.id, None)
        fenced = epoch is not None and self.landing.fence(req.id, epoch) is not None
        self.counts.fences += fenced
        self.planner.transfer_failed(req.id, reason,
                                     fence_key=(req.id, epoch) if fenced else None)
        self.send(req.peer, PeerRpc.TRANSFER_ACK,
                  self._ack(req.id, epoch or 0, release_only=True))

    def landed(self, ev) -> None:
        """D: a write's notification (LANDED) arrived."""
        if not self.current(ev.peer.engine_id, ev.peer.epoch):
            return          # an older P's write: its landings went when it did
        verdict = self.landing.on_notification(ev.req_id, ev.epoch, ev.peer)
        if verdict is LandingVerdict.DRAINED:
            self.planner.release_fence((ev.req_id, ev.epoch))
        elif verdict is LandingVerdict.LANDED and ev.req_id in self.planner.landing:
            self.epochs.pop(ev.req_id, None)
            self.counts.transfers += 1
            self.breaker.close(ev.peer.engine_id)
            req = self.planner.requests[ev.req_id]
            lp = None
            if ev.payload:
                m = rpb.TokenLogprob.FromString(ev.payload)
                lp = Logprob(m.token_id, m.logprob, tuple((t.token_id, t.logprob)
                                                          for t in m.top))
            stopped = self.executor.on_token(req, ev.first_token, lp)
            finished = self.planner.transfer_landed(ev.req_id, ev.first_token, stopped,
                                                    ev.drafts)
            self.delivered(req, finished)
            self.send(req.peer, PeerRpc.TRANSFER_ACK, self._ack(ev.req_id, ev.epoch))

    def decode_timers(self, now: float) -> None:
        """D: landings that timed out are given up on; heartbeats to the Ps."""
        for ld in self.landing.timed_out(now):
            req = self.planner.requests.get(ld.req_id)
            self.breaker.failed(ld.source.engine_id, now)
            self.recover_locally(ld.req_id, ld.epoch, "transfer timed out", fence=True,
                                 stage="timeout")
            if req is not None and req.peer:
                self.send(req.peer, PeerRpc.TRANSFER_ACK,
                          self._ack(ld.req_id, ld.epoch, release_only=True))
        if now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            self._heartbeats()

    def _heartbeats(self) -> None:
        """D: one heartbeat to each P it waits on: the requests whose leases
        to renew, and the landings it gave up on and holds quarantined (P
        answers each with TransferEnded once no write of it is left)."""
        waiting: dict[str | None, list[str]] = {}
        fenced: dict[str, list[pb.LandingRef]] = {}
        for req in self.planner.landing.values():
            waiting.setdefault(req.peer, []).append(req.id)
        for ld in self.landing.quarantined():
            fenced.setdefault(ld.source.engine_id, []).append(
                pb.LandingRef(request_id=ld.req_id, epoch=ld.epoch))
        for peer in list(waiting) + [p for p in fenced if p not in waiting]:
            self.send(peer, PeerRpc.LEASE_HEARTBEAT, pb.HeartbeatRequest(
                engine=self.name, incarnation=self.me.epoch, request_ids=waiting.get(peer, []),
                fenced=fenced.get(peer or "", [])))

    def transfer_failed_from_peer(self, r: pb.TransferFailedRequest) -> None:
        # the write failed on P's side and will not land: no fence needed
        if not self.current(r.engine, r.incarnation):
            return
        ld = self.landing.get(r.request_id, r.epoch)
        if ld is None or ld.source != Incarnation(r.engine, r.incarnation):
            return                  # not a landing asked of that P
        if self.epochs.get(r.request_id) == r.epoch and self.landing.forget(r.request_id, r.epoch):
            req = self.planner.requests.get(r.request_id)
            self.recover_locally(r.request_id, r.epoch, r.reason, fence=False,
                                 stage="reported_by_prefill")
            if req is not None:
                self.send(req.peer, PeerRpc.TRANSFER_ACK,
                          self._ack(r.request_id, r.epoch, release_only=True))

    def transfer_ended_from_peer(self, r: pb.TransferEndedRequest) -> None:
        """D: P says no write of this landing is in flight or will be posted:
        a quarantined landing's pages come back; one D still waits on (P
        never took the ask) is prefilled here, with nothing to fence."""
        if not self.current(r.engine, r.incarnation):
            return
        if r.stopped:                       # every landing asked of that incarnation
            self.peer_gone(r.engine, before=r.incarnation + 1)
            return
        ld = self.landing.ended(r.request_id, r.epoch, Incarnation(r.engine, r.incarnation))
        if ld is None:
            return
        if ld.fenced:
            self.planner.release_fence((ld.req_id, ld.epoch))
        elif self.epochs.get(ld.req_id) == ld.epoch:
            self.recover_locally(ld.req_id, ld.epoch, f"prefill engine {r.engine} wrote nothing",
                                 fence=False, stage="ended_by_prefill")

    def peer_gone(self, engine: str, before: int | None = None) -> None:
        """D: P `engine`'s incarnations older than `before` (None: all of
        them) are gone (a restart, or membership removed it): they write
        nothing more. Their quarantined landings come back, and a landing
        still waiting on one is prefilled here."""
        for ld in self.landing.sources_gone(engine, before):
            if ld.fenced:
                self.planner.release_fence((ld.req_id, ld.epoch))
            elif ld.req_id in self.planner.landing:
                self.epochs.pop(ld.req_id, None)
                self.counts.transfer_failed("prefill_gone")
                self.planner.transfer_failed(
                    ld.req_id, f"prefill engine {engine} restarted or died", fence_key=None)
