"""P's half of the peer protocol: the twin it prefills for D under a
lease, the write that ships it, D's ack or release, the ask floor that
keeps a late RemotePrefill out of a landing D gave up on, and the reports
it owes D (TransferFailed, TransferEnded; at its stop, that nothing of it
is left). P never frees a source page a posted write may still read: a
twin let go with its write in flight drains, pinned, until the transport
says the write ended."""

from __future__ import annotations

from pdserve.engine.lora.adapters import adapter_of
from pdserve.engine.outputs import logprob_pb
from pdserve.engine.peer.base import PeerBase, Release, log
from pdserve.engine.peer.messages import PeerRpc
from pdserve.proto import control_pb2 as pb
from pdserve.proto.sampling import from_options
from pdserve.scheduler.planner import RejectedRequest
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.scheduler.round.grammar import Role
from pdserve.transfer import Incarnation, KvWrite, TransferEventKind


class PrefillSide(PeerBase):
    def remote_prefill(self, r: pb.RemotePrefillRequest) -> None:
        self.drain.refuse("prefill")
        if r.request_id in self.planner.requests:
            raise RejectedRequest(f"request id {r.request_id!r} is live on {self.name}")
        if self.role is not Role.PREFILL:
            raise RejectedRequest(f"{self.name} is a {self.role.value} engine: send "
                                  "RemotePrefill to a prefill engine")
        # P computes the KV D decodes over: under the very adapter load D runs
        adapter = adapter_of(self.executor.adapters, self.name, r.adapter, r.adapter_id)
        peer = self.peers.get(r.target_engine)
        if peer is None:
            raise RejectedRequest(f"{self.name} does not know decode engine {r.target_engine!r}")
        if r.target_incarnation < peer.incarnation:
            self.counts.stale_messages += 1
        if peer.incarnation != r.target_incarnation:
            raise RejectedRequest(f"{self.name} knows {r.target_engine} at incarnation "
                                  f"{peer.incarnation}, not {r.target_incarnation}")
        if r.prefill_incarnation != self.me.epoch:
            raise RejectedRequest(f"the ask is for {self.name}@{r.prefill_incarnation}, this is "
                                  f"{self.me.agent_name}")
        floor = self.ask_floor.get(r.target_engine)
        if floor is not None and floor[0] == r.target_incarnation and r.epoch <= floor[1]:
            raise RejectedRequest(f"{r.target_engine} gave up on landings up to epoch "
                                  f"{floor[1]}; this ask (epoch {r.epoch}) came too late")
        limit = self.transport.peer_pages(r.target_engine)
        if limit is not None and any(p >= limit for p in r.landing_pages):
            raise RejectedRequest(f"landing page {max(r.landing_pages)} is outside "
                                  f"{r.target_engine}'s pool of {limit} pages")
        twin = Request(r.request_id, list(r.token_ids), SamplingLimits(max_new_tokens=1),
                       adapter=adapter)
        twin.first_page = r.first_page
        try:            # the first token only: EOS and stop ids masked as on D
            sp = from_options(r.sampling, max_tokens=1, min_tokens=min(r.sampling.min_tokens, 1),
                              stop=())
        except ValueError as e:
            raise RejectedRequest(str(e)) from None
        if r.prior_output > len(r.token_ids):
            raise RejectedRequest(f"prior_output={r.prior_output} exceeds the request's "
                                  f"{len(r.token_ids)} tokens")
        self.executor.register(twin.id, sp, fallback_seed=hash(twin.id) & 0xFFFFFFF,
                            prior_output=r.prior_output)
        self.planner.submit(twin)
        self.remote[twin.id] = (r.target_engine, r.target_incarnation, tuple(r.landing_pages),
                                r.epoch)
        self.leases.grant(twin.id, Incarnation(r.target_engine, r.target_incarnation),
                          self.clock())

    def ship(self, op) -> None:
        info = self.remote.get(op.req.id)
        if info is None:
            return
        d_name, d_inc, pages, epoch = info
        if not self.leases.holds(op.req.id, self.clock()):
            return                  # the lease ran out: the timers release it, nothing is posted
        t = self.executor.tracked.get(op.req.id)
        payload = logprob_pb(t.logprobs[-1]).SerializeToString() if t and t.logprobs else b""
        src = self.transport.page_ids(self.executor.transfer_lists(op.src))
        if len(src) != len(pages):
            # the two engines group the model's layers differently: nothing sensible to write
            self.send(d_name, PeerRpc.TRANSFER_FAILED, self._failed(
                op.req.id, epoch, f"{self.name} ships {len(src)} pages where the landing has "
                f"{len(pages)}: run the same model and engine.page_size on both roles"))
            return
        self.transport.write(KvWrite(op.req.id, epoch, Incarnation(d_name, d_inc),
                                     src, pages, op.first_token, payload, tuple(op.drafts),
                                     source=self.me))
        self.counts.transfers += 1
        self.counts.transfer_bytes += self.transport.bytes_of(src)

    def _failed(self, req_id: str, epoch: int, reason: str) -> pb.TransferFailedRequest:
        return pb.TransferFailedRequest(request_id=req_id, epoch=epoch, reason=reason,
                                        engine=self.name, incarnation=self.me.epoch)

    def transfer_ack(self, r: pb.TransferAckRequest) -> None:
        if not self.current(r.engine, r.incarnation):
            return          # from an older incarnation of that D (or one not known yet)
        if r.release_only and r.epoch:      # D gave that landing up: it waits for our word
            self.landing_given_up(r.engine, r.incarnation, r.request_id, r.epoch)
            return
        info = self.remote.get(r.request_id)
        if info is None:
            return          # nothing of it held for a peer (or a stale, repeated ack)
        if info[0] != r.engine or info[1] != r.incarnation or (r.epoch and info[3] != r.epoch):
            return          # for an earlier attempt at this id, from another D or landing
        self._let_go(r.request_id, Release.ACKED)

    def heartbeat(self, r: pb.HeartbeatRequest) -> int:
        """P: D still waits on `request_ids` (their leases are renewed, none
        that expired) and gave up on the `fenced` landings; returns how many
        leases it renewed."""
        if not self.current(r.engine, r.incarnation):
            return 0
        n = self.leases.renew(Incarnation(r.engine, r.incarnation), r.request_ids,
                              self.clock())
        for ref in r.fenced:
            self.landing_given_up(r.engine, r.incarnation, ref.request_id, ref.epoch)
        return n

    def landing_given_up(self, d_name: str, d_inc: int, req_id: str, epoch: int) -> None:
        """P: D gave up on landing `epoch` of `req_id` and holds its pages
        until told no write of it is left. From now on no ask at or below
        that epoch from this D is taken; the twin, if this is its landing,
        is let go (its write cancelled where the transport can); and D is
        told once no write of it runs (at once, if none does)."""
        floor = self.ask_floor.get(d_name)
        if floor is None or floor[0] < d_inc or (floor[0] == d_inc and floor[1] < epoch):
            self.ask_floor[d_name] = (d_inc, epoch)
        info = self.remote.get(req_id)
        if info is not None and (info[0], info[1], info[3]) == (d_name, d_inc, epoch):
            self.end_owed[req_id] = (d_name, epoch)
            self._let_go(req_id, Release.ACKED)   # told once it ended (_release)
            return
        self._report_ended(d_name, req_id, epoch)

    def stopped(self) -> None:
        """P, drained and about to stop: it holds no twin and no write is in
        flight (the drain waited for both), and its inbox takes no more
        asks. Each D is told so, for every landing asked of this
        incarnation: one it gave up on and still holds quarantined (its
        question may not have reached P before the drain ended) comes back
        without waiting for a P that is gone."""
        if self.role is not Role.PREFILL or not self.idle():
            return
        for name in self.peers:
            self.send(name, PeerRpc.TRANSFER_ENDED, pb.TransferEndedRequest(
                engine=self.name, incarnation=self.me.epoch, stopped=True))

    def _report_ended(self, d_name: str, req_id: str, epoch: int) -> None:
        self.send(d_name, PeerRpc.TRANSFER_ENDED, pb.TransferEndedRequest(
            request_id=req_id, epoch=epoch, engine=self.name, incarnation=self.me.epoch))

    def write_ended(self, ev) -> None:
        """P: a write of ours ended (DONE, FAILED or CANCELLED)."""
        if ev.kind is TransferEventKind.DONE:         # P: our write completed
            self.counts.transfer_seconds.observe(ev.seconds)
            self._drained(ev.req_id)
        elif ev.kind is TransferEventKind.FAILED:       # P: our write will not land
            info = self.remote.get(ev.req_id)
            self.counts.transfer_failed("write")
            if info is not None:
                self.send(info[0], PeerRpc.TRANSFER_FAILED, self._failed(ev.req_id, ev.epoch,
                                                                         ev.reason))
            self._drained(ev.req_id)
        elif ev.kind is TransferEventKind.CANCELLED:    # P: we stopped it; it reads no more
            self._drained(ev.req_id)

    def prefill_timers(self, now: float) -> None:
        """P: leases that ran out let their twins go; drains a fault hid."""
        for rid in self.leases.expired(now):
            if rid in self.planner.requests:
                self.counts.lease_expiries += 1
            self._let_go(rid, Release.EXPIRED)
        for rid in list(self.draining):     # an end whose event a fault swallowed
            self._drained(rid)

    def _let_go(self, rid: str, why: Release) -> None:
        """P is done with twin `rid` (D acked it, or its lease ran out): no
        more renewals or posts; a write still running is cancelled where
        the transport can, and the pages stay pinned until it ended. A
        twin already draining keeps its first reason."""
        self.leases.release(rid)
        if rid in self.draining:
            return
        self.transport.cancel(rid)
        if self.transport.in_flight(rid) and rid in self.planner.requests:
            self.draining[rid] = why
            log.info("%s: %s %s while its write is in flight: pages held until it ends",
                     self.name, rid, why.value)
            return
        self._release(rid, why)

    def _drained(self, rid: str) -> None:
        """A write of `rid` ended: if P already let the twin go, and no
        write of it reads its pages any more, they go now."""
        why = self.draining.get(rid)
        if why is not None and not self.transport.in_flight(rid):
            del self.draining[rid]
            self._release(rid, why)

    def _release(self, rid: str, why: Release) -> None:
        if rid in self.planner.requests:
            if why is Release.ACKED:
                self.planner.peer_ack(rid)
            else:
                self.planner.abort(rid, "lease expired" if why is Release.EXPIRED else "aborted")
        self.remote.pop(rid, None)
        self.executor.forget(rid)
        owed = self.end_owed.pop(rid, None)
        if owed is not None:                # no write of it runs now
            self._report_ended(owed[0], rid, owed[1])

    def writing(self, req_id: str) -> bool:
        """P: a write of twin `req_id` may still read its source pages."""
        return req_id in self.remote and self.transport.in_flight(req_id)

    def abort_twin(self, req_id: str) -> None:
        """P aborts a twin whose write is in flight: it goes like an expired
        lease, its pages pinned until the write ended (see `_let_go`)."""
        self._let_go(req_id, Release.ABORTED)

    def release_twin(self, req_id: str) -> None:
        """P aborts a twin (the planner already let it go): its lease and
        any write still held back go, and a drain of it ends here, so a
        later twin under the same id is never released in its place."""
        self.leases.release(req_id)
        self.remote.pop(req_id, None)
        self.draining.pop(req_id, None)
        self.transport.cancel(req_id)
        owed = self.end_owed.pop(req_id, None)
        if owed is not None and not self.transport.in_flight(req_id):
            self._report_ended(owed[0], req_id, owed[1])

    def give_up(self, req_id: str, reason: str) -> None:
        """P lets a twin go before shipping it (a drain's deadline): D is
        told the write will not come, so it prefills locally at once. A twin
        already shipped is not reported: its write may still land."""
        info = self.remote.get(req_id)
        if info is not None and req_id not in self.planner.transferring:
            self.send(info[0], PeerRpc.TRANSFER_FAILED,
                      self._failed(req_id, info[3], f"{self.name}: {reason}"))
