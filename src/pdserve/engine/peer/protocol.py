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

import enum
import logging
import time
from typing import Callable

import grpc

from pdserve.text.sampling_params import Logprob
from pdserve.proto.control_tls import ControlTls, channel
from pdserve.proto import control_pb2 as pb
from pdserve.proto import control_pb2_grpc as pbg
from pdserve.proto import router_pb2 as rpb
from pdserve.proto.sampling import from_options, to_options
from pdserve.engine.lora.adapters import adapter_of, name_of
from pdserve.engine.drain import Drain
from pdserve.engine.stats import EngineCounters
from pdserve.engine.outputs import logprob_pb
from pdserve.engine.peer.messages import Peer, PeerRpc, PeerSender
from pdserve.engine.spec.speculation import check_peer_spec
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.planner import RejectedRequest
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer import (
    Incarnation, KvWrite, LandingTable, LandingVerdict, LeaseTable, TransferEventKind)
from pdserve.transfer.timeouts import PeerTimeouts

log = logging.getLogger("pdserve.engine")

__all__ = ["PeerProtocol", "PeerTimeouts", "Release"]


class Release(enum.Enum):
    """Why P lets a twin go, once no write of it reads its pages."""
    ACKED = "acked"             # D acknowledged (it has the KV, or wants it no more)
    EXPIRED = "expired"         # the lease ran out: D said nothing for lease_s
    ABORTED = "aborted"         # P aborted it (a drain's deadline)


class PeerProtocol:
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

    # ---- membership --------------------------------------------------------------
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
        if old is not None:
            self.peer_gone(r.engine, before=r.incarnation)

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
                self.planner.transfer_failed(ld.req_id, f"prefill engine {engine} restarted",
                                             fence_key=None)

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

    # ---- D: asking P, and what comes back --------------------------------------
    def ask_prefill(self, op) -> None:
        req = op.req
        if req.peer is None or req.peer not in self.peers:
            self.recover_locally(req.id, 0, "no prefill peer", fence=False, stage="no_peer")
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

    def on_transfer_event(self, ev) -> None:
        if ev.kind is TransferEventKind.LANDED:
            if not self.current(ev.peer.engine_id, ev.peer.epoch):
                return          # an older P's write: its landings went when it did
            verdict = self.landing.on_notification(ev.req_id, ev.epoch, ev.peer)
            if verdict is LandingVerdict.DRAINED:
                self.planner.release_fence((ev.req_id, ev.epoch))
            elif verdict is LandingVerdict.LANDED and ev.req_id in self.planner.landing:
                self.epochs.pop(ev.req_id, None)
                self.counts.transfers += 1
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
        elif ev.kind is TransferEventKind.DONE:         # P: our write completed
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

    def timers(self, now: float) -> None:
        if self.role is Role.DECODE:
            for ld in self.landing.timed_out(now):
                req = self.planner.requests.get(ld.req_id)
                self.recover_locally(ld.req_id, ld.epoch, "transfer timed out", fence=True,
                                     stage="timeout")
                if req is not None and req.peer:
                    self.send(req.peer, PeerRpc.TRANSFER_ACK,
                              self._ack(ld.req_id, ld.epoch, release_only=True))
            if now - self._last_heartbeat >= self.heartbeat_s:
                self._last_heartbeat = now
                self._heartbeats()
        elif self.role is Role.PREFILL:
            for rid in self.leases.expired(now):
                if rid in self.planner.requests:
                    self.counts.lease_expiries += 1
                self._let_go(rid, Release.EXPIRED)
            for rid in list(self.draining):     # an end whose event a fault swallowed
                self._drained(rid)

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

    # ---- P: prefilling for D, shipping, acks ------------------------------------
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
