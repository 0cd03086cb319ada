"""A P planner and a D planner wired together in-process: what the cluster
does between them, without a cluster (the handoff of spec §3.1 and §3.2)."""

from __future__ import annotations

from pdserve.scheduler import Planner, Request, SamplingLimits
from pdserve.scheduler.round.grammar import Role

from support.planner import config, result_for


class PDPair:
    def __init__(self, p_cfg=None, d_cfg=None, lease_rounds: int = 0, groups=None,
                 lora_slots: int = 0):
        kw: dict = {"groups": groups} if groups else {}
        kw["lora_slots"] = lora_slots
        self.P = Planner(p_cfg or config(), Role.PREFILL, **kw)
        self.D = Planner(d_cfg or config(), Role.DECODE, **kw)
        self.landing = {}            # req id -> pages per group D reserved for the peer
        self.in_flight = []          # (req id, first token) shipped, not yet landed
        self.fail_next = set()       # request ids whose transfer fails
        self.lose_ack = set()        # request ids whose ack never reaches P
        self.lease_rounds = lease_rounds   # ticks P waits for a lost ack before letting go
        self.leased = {}             # req id -> ticks left on P's lease (its ack was lost)
        self.finished = []

    def submit(self, req: Request) -> None:
        self.D.submit(req)

    def tick(self):
        """One D round, one P round, then deliver what crossed between them."""
        dplan = self.D.build()
        for op in dplan.remote_prefills:
            r = op.req
            twin = Request(r.id, r.prompt, SamplingLimits(max_new_tokens=1), adapter=r.adapter)
            twin.first_page = op.first_page
            self.landing[r.id] = [len(pages) for pages in op.landing]
            self.P.submit(twin)
        self.finished += self.D.apply(dplan, result_for(dplan))
        pplan = self.P.build()
        self.P.apply(pplan, result_for(pplan))
        for op in pplan.remote_decodes:
            # P sends, per group, exactly the slots D reserved (a sliding
            # group's last window, not the prompt)
            assert [len(pages) for pages in op.src] == self.landing.pop(op.req.id), op.req
            self.in_flight.append((op.req.id, op.first_token))
        self.deliver()
        self.expire_leases()
        self.D.check_invariants()
        self.P.check_invariants()
        return dplan, pplan

    def deliver(self) -> None:
        shipped, self.in_flight = self.in_flight, []
        for rid, tok in shipped:
            if rid not in self.D.requests:
                self.P.peer_ack(rid)                 # D aborted meanwhile: let go
                continue
            if rid in self.fail_next:
                self.fail_next.discard(rid)
                self.D.transfer_failed(rid, "injected transfer failure")
                self.P.peer_ack(rid)                 # D tells P to let go
                continue
            self.finished += self.D.transfer_landed(rid, tok)
            if rid in self.lose_ack:
                self.leased[rid] = self.lease_rounds  # only the lease ends it on P
            else:
                self.P.peer_ack(rid)

    def expire_leases(self) -> None:
        for rid, left in list(self.leased.items()):
            if left > 0:
                self.leased[rid] = left - 1
                continue
            del self.leased[rid]
            self.P.abort(rid, "lease expired")

    def run(self, max_rounds: int = 10_000) -> list:
        for _ in range(max_rounds):
            if not (self.D.has_work() or self.P.has_work() or self.in_flight):
                return self.finished
            dplan, pplan = self.tick()
            assert not (dplan.is_empty() and pplan.is_empty() and not self.leased), \
                "both sides stalled"
        raise AssertionError("did not finish")
