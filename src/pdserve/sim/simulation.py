"""`pdserve sim`: a cluster of engines on virtual time, driven by a trace.

Each engine is the real planner behind a `SimExecutor`. A discrete-event
loop always advances whichever comes first: the next event (an arrival, a
message between engines, a transfer landing, a fault) or the runnable
engine with the earliest clock. Ties go to the earlier-made event and the
lower engine index, so a run is a pure function of trace, config and faults.

Disaggregated flow (DESIGN.md): the router pairs a request with a D and a P
(least outstanding tokens); D's remote admission sends the prompt to P; P
prefills and ships KV over a modelled link (bytes per page from the model
preset, the link's bandwidth and latency, one transfer at a time per P); D
sees it land, acks P, and decodes. Each engine's planner serves the model
preset's cache groups (full history, sliding windows), a shipped page
costing its group's layers. Round times come from the GPU and model
presets' roofline, or from a measured profile (`simulate.profile`,
`pdserve calibrate`). A failed transfer, a lost ack (P's lease
expires) and a dead engine each take their path through the planners.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.config import ServeConfig
from pdserve.sim.fault_plan import Fault
from pdserve.sim.report import Record, SloWatch, format_summary, goodput, summarize
from pdserve.sim.trace import TraceRequest
from pdserve.sim.cost.profile import simulated_cost
from pdserve.engine.engine import Engine
from pdserve.sim.executor import SimExecutor
from pdserve.sim.lora import SimLora, TraceAdapters
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.plan import Plan
from pdserve.scheduler.planner import Planner, RejectedRequest
from pdserve.scheduler.request import Request, SamplingLimits

__all__ = ["Simulation", "format_summary", "goodput"]


@dataclass
class SimEngine:
    engine: Engine
    index: int
    role: Role
    load: int = 0                 # outstanding tokens routed here and not finished
    live: dict = field(default_factory=dict)   # req id -> routed load
    stalled: bool = False         # built nothing with nothing to wait for: a bug
    parked: bool = False          # built nothing while waiting on a peer
    alive: bool = True
    link_free_at: float = 0.0     # P: when its KV link is next free
    # D: landings arrived and not seen yet (simulate.ack_delay_rounds):
    # (the executor round it sees them in, the landing's arguments)
    held_landings: list = field(default_factory=list)
    round_start: float = 0.0      # when its last round began (it ends at `clock`)

    @property
    def clock(self) -> float:
        return self.engine.executor.now

    @property
    def planner(self) -> Planner:
        return self.engine.planner

    @property
    def name(self) -> str:
        return self.engine.name

    def runnable(self) -> bool:
        return self.alive and not self.stalled and not self.parked and self.engine.has_work()


def sim_groups(cfg: ServeConfig, model) -> list:
    """The preset's cache groups as this config's engines serve them."""
    return [dataclasses.replace(g, block=cfg.engine.state_block) if g.state else g
            for g in model.groups(sliding=cfg.simulate.sliding_groups)]


def build_engines(cfg: ServeConfig, cost=None, lora: bool = False) -> list[SimEngine]:
    """`cost`: the cost model (default: the config's, `simulated_cost`);
    `lora`: the trace names adapters, so each engine has `lora.max_loras`
    slots and their cost (sim/lora.py)."""
    if cost is None:
        s = cfg.simulate
        cost = simulated_cost(s.gpu, s.model, s.profile)[1]
    model = cost.model
    engine_cfg = cfg.engine
    if "max_context_tokens" not in cfg.engine_overrides:
        engine_cfg = dataclasses.replace(engine_cfg, max_context_tokens=model.context)
    # the preset's cache groups, each with its own pool (capacity.group_pages:
    # engine.total_pages for full history, engine.sliding_pages for a window,
    # engine.state_slots for a state group checkpointed every engine.state_block)
    groups = sim_groups(cfg, model)
    group_bytes = model.group_page_bytes(groups, engine_cfg.page_size)
    out: list[SimEngine] = []
    disk = None
    if engine_cfg.disk_cache is not None:
        from pdserve.sim.disk import SimDisk

        s = cfg.simulate
        disk = SimDisk(max(engine_cfg.disk_cache.max_bytes // group_bytes[0], 1),
                       s.disk_read_gbps, s.disk_write_gbps)
    for role, count in ((Role.FUSED, cfg.cluster.fused), (Role.PREFILL, cfg.cluster.prefill),
                        (Role.DECODE, cfg.cluster.decode)):
        if role is not Role.FUSED and cfg.cluster.decode == 0:
            continue                  # prefill engines with no decode peer would idle
        for i in range(count):
            ex = SimExecutor(cost, engine_cfg.page_size, group_page_bytes=group_bytes,
                             ack_delay_rounds=cfg.simulate.ack_delay_rounds)
            if disk is not None:
                from pdserve.sim.disk import SimDiskEdge

                assert engine_cfg.disk_cache is not None
                ex.disk = SimDiskEdge(disk, engine_cfg.page_size, group_bytes[0],
                                      engine_cfg.disk_cache.min_hit_tokens)
            slots = cfg.lora.max_loras if lora else 0
            if lora:
                ex.lora = SimLora(cost, slots, cfg.lora.max_lora_rank)
            eng = Engine(f"{role.value}-{i}", Planner(engine_cfg, role, groups=groups,
                                                      lora_slots=slots), ex)
            out.append(SimEngine(eng, len(out), role))
    return out


class Simulation:
    def __init__(self, cfg: ServeConfig, trace: list[TraceRequest], plan_log=None,
                 progress: bool = True, all_strict: bool = False, faults: Sequence[Fault] = (),
                 watch: SloWatch | None = None):
        """`watch`: stop as soon as it finds the SLO attainment out of reach
        (the unreached requests stay unfinished)."""
        self.cfg = cfg
        self.watch = watch
        self.all_strict = all_strict
        s = cfg.simulate
        model, cost = simulated_cost(s.gpu, s.model, s.profile)
        self.adapters = TraceAdapters(dict(cfg.lora.adapters),
                                      [t.adapter for t in trace if t.adapter])
        self.engines = build_engines(cfg, cost, lora=self.adapters.used)
        self.faults = list(faults)
        self.records = {t.id: Record(t.id, t.arrival_s) for t in trace}
        self.order = [t.id for t in trace]
        self.n = len(trace)
        self.plan_log = plan_log
        self.progress = progress
        self.rounds = 0
        self.peak_resident = 0        # most requests holding pages on one engine after a round
        self.counters = {"remote_prefills": 0, "transfers": 0, "transfer_failures": 0,
                         "local_recoveries": 0, "lost_acks": 0, "lease_expiries": 0,
                         "engine_deaths": 0, "failed_by_death": 0}
        self._page_bytes = model.group_page_bytes(sim_groups(cfg, model), cfg.engine.page_size)
        self._link_bps = cfg.simulate.link_gbps * 1e9 / 8
        self._events: list = []
        self._seq = 0
        self._done = 0
        self._stalls_seen: dict[int, int] = {}
        for t in sorted(trace, key=lambda t: t.arrival_s):
            self._push(t.arrival_s, "arrive", t)
        if watch is not None:     # deadlines only count misses: they wake no engine
            for t in sorted(trace, key=lambda t: t.arrival_s):
                self._push(t.arrival_s + watch.slo.ttft_s, "deadline", t.id)
        for f in self.faults:
            if f.kind == "engine_death":
                self._push(f.at_s, "death", f)

    # ---- events ----------------------------------------------------------
    def _push(self, t: float, kind: str, *args) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, args))

    def _wake(self, se: SimEngine, t: float) -> None:
        """An event reached `se` at time t: an idle or parked engine's clock
        jumps to it; a running one is already past it."""
        if se.parked or not se.engine.has_work():
            se.engine.executor.now = se.round_start = max(se.clock, t)
        se.parked = False

    def _fault(self, kind: str, now: float, engine: str) -> bool:
        for f in self.faults:
            if f.kind == kind and f.matches(now, engine):
                f.fired = True
                return True
        return False

    def _deliver(self, t: float, kind: str, args) -> None:
        getattr(self, "_on_" + kind)(t, *args)

    def _on_arrive(self, t: float, tr: TraceRequest) -> None:
        rec = self.records[tr.id]
        front = [e for e in self.engines
                 if e.alive and not e.stalled and e.role is not Role.PREFILL]
        if not front:
            rec.status, rec.error = "failed", "no live engine can serve a request"
            self._done += 1
            return
        target = min(front, key=lambda e: (e.load, e.index))
        try:
            adapter = self.adapters.resolve(tr.adapter)
        except KeyError as e:
            rec.status, rec.error = "rejected", str(e.args[0])
            self._done += 1
            return
        req = Request(tr.id, tr.prompt, SamplingLimits(max_new_tokens=tr.max_new_tokens,
                                                       strict=tr.strict or self.all_strict),
                      adapter=adapter)
        self._wake(target, t)
        try:
            target.engine.submit(req, tr.output_tokens)
        except RejectedRequest as e:
            rec.status, rec.error = "rejected", str(e)
            self._done += 1
            return
        load = req.prompt_len + req.max_new_tokens
        target.live[tr.id] = load
        target.load += load
        if target.role is Role.DECODE:
            # the prefill peer is charged now, not when the prompt reaches it,
            # so a burst of arrivals spreads over the P engines
            peers = [e for e in self.engines if e.alive and e.role is Role.PREFILL]
            if peers:
                p = min(peers, key=lambda e: (e.load, e.index))
                req.peer = p.index  # type: ignore[assignment]
                p.live[tr.id] = req.prompt_len
                p.load += req.prompt_len

    def _on_deadline(self, t: float, rid: str) -> None:
        if self.records[rid].first_token_s is None:
            self.watch.miss(rid)  # type: ignore[union-attr]

    def _on_p_submit(self, t: float, d_idx: int, p_idx, rid: str, prompt, first_page: int,
                     adapter: int = 0):
        p = self.engines[p_idx] if p_idx is not None else None
        if not self.engines[d_idx].alive:
            if p is not None:
                p.load -= p.live.pop(rid, 0)     # the asker died: nothing to prefill
            return
        if p is None or not p.alive:
            self._push(t + self.cfg.simulate.lease_s, "failed", d_idx, rid, None,
                       "no live prefill engine answered")
            return
        twin = Request(rid, prompt, SamplingLimits(max_new_tokens=1), adapter=adapter)
        twin.first_page, twin.peer = first_page, d_idx  # type: ignore[assignment]
        self._wake(p, t)
        try:
            p.engine.submit(twin)
        except RejectedRequest as e:
            p.load -= p.live.pop(rid, 0)
            self._push(t + self.cfg.simulate.link_latency_s, "failed", d_idx, rid, None,
                       f"{p.name} refused the prompt: {e}")

    def _on_landed(self, t: float, d_idx: int, rid: str, token: int, p_idx: int) -> None:
        d = self.engines[d_idx]
        if not d.alive:                              # nobody will ack: P's lease lets go
            self._push(t + self.cfg.simulate.lease_s, "lease_expired", p_idx, rid)
            return
        if rid not in d.planner.landing:
            self._push(t + self.cfg.simulate.link_latency_s, "ack", p_idx, rid)
            return
        self._wake(d, t)
        delay = self.cfg.simulate.ack_delay_rounds
        if delay:
            # seen `delay` rounds of D's later (_step); its pages stay pinned meanwhile
            d.held_landings.append((d.engine.executor.rounds + delay, (t, d_idx, rid, token, p_idx)))
            return
        self._land(d, t, rid, token, p_idx)

    def _land(self, d: SimEngine, t: float, rid: str, token: int, p_idx: int) -> None:
        if rid not in d.planner.landing:     # aborted or failed while held
            self._push(t + self.cfg.simulate.link_latency_s, "ack", p_idx, rid)
            return
        # an engine polls its transport between rounds: a landing that arrives
        # mid-round is seen, and its first token streamed, when the round ends
        t = max(t, d.clock)
        finished = d.planner.transfer_landed(rid, token, stopped=d.engine.executor.stops_at(rid, 1))
        rec = self.records[rid]
        if rec.first_token_s is None:
            rec.first_token_s = t
        self._finished(d, finished, t)
        if self._fault("ack_lost", t, self.engines[p_idx].name):
            self.counters["lost_acks"] += 1
            self._push(t + self.cfg.simulate.lease_s, "lease_expired", p_idx, rid)
        else:
            self._push(t + self.cfg.simulate.link_latency_s, "ack", p_idx, rid)

    def _on_failed(self, t: float, d_idx: int, rid: str, p_idx, reason: str) -> None:
        d = self.engines[d_idx]
        if d.alive and rid in d.planner.landing:
            self._wake(d, t)
            d.planner.transfer_failed(rid, reason)
            self.counters["local_recoveries"] += 1
        if p_idx is not None:
            self._push(t + self.cfg.simulate.link_latency_s, "ack", p_idx, rid)

    def _release_on_p(self, p: SimEngine, rid: str, how) -> bool:
        if not p.alive or rid not in p.planner.requests:
            p.load -= p.live.pop(rid, 0)
            return False
        how(rid)
        p.load -= p.live.pop(rid, 0)
        return True

    def _on_ack(self, t: float, p_idx: int, rid: str) -> None:
        p = self.engines[p_idx]
        self._wake(p, t)
        self._release_on_p(p, rid, p.planner.peer_ack)

    def _on_lease_expired(self, t: float, p_idx: int, rid: str) -> None:
        p = self.engines[p_idx]
        self._wake(p, t)
        if self._release_on_p(p, rid, lambda r: p.planner.abort(r, "lease expired")):
            self.counters["lease_expiries"] += 1

    def _on_death(self, t: float, fault: Fault) -> None:
        se = next(e for e in self.engines if e.name == fault.engine)
        if not se.alive:
            return
        fault.fired = True
        se.alive = False
        self.counters["engine_deaths"] += 1
        lease = self.cfg.simulate.lease_s
        if se.role is Role.PREFILL:
            for d in self.engines:
                if d.alive and d.role is Role.DECODE:
                    for req in list(d.planner.landing.values()):
                        if req.peer == se.index:
                            self._push(t + lease, "failed", d.index, req.id, None,
                                       f"prefill engine {se.name} died")
            return
        for rid in list(se.live):
            rec = self.records[rid]
            rec.status, rec.error = "failed", f"{se.name} died at {t:.3f}s"
            self._done += 1
            self.counters["failed_by_death"] += 1
        for p in self.engines:
            if p.alive and p.role is Role.PREFILL:
                for req in list(p.planner.requests.values()):
                    if req.peer == se.index:
                        self._push(t + lease, "lease_expired", p.index, req.id)
                for rid in [r for r in p.live if r in se.live and r not in p.planner.requests]:
                    p.load -= p.live.pop(rid)       # charged, never sent: nothing to release

    # ---- one engine round ------------------------------------------------
    def _finished(self, se: SimEngine, reqs, now: float) -> None:
        for req in reqs:
            rec = self.records[req.id]
            rec.status = "finished"
            rec.finish_s = now
            rec.output_tokens = len(req.output)
            rec.retractions = req.retractions
            if self.watch is not None:
                self.watch.check(rec)
            se.load -= se.live.pop(req.id)
            se.engine.executor.forget(req.id)
            self._done += 1

    def _step(self, se: SimEngine) -> None:
        t0 = se.clock
        se.engine.executor.neighbours = sum(
            1 for e in self.engines if e is not se and e.alive and e.round_start <= t0 < e.clock)
        se.round_start = t0
        if se.held_landings:
            self._land_due(se)
        out = se.engine.step()
        pl = se.planner
        for msg in pl.stalls[self._stalls_seen.get(se.index, 0):]:
            print(f"pdserve sim: {se.name}: liveness last resort: {msg}", file=sys.stderr)
        self._stalls_seen[se.index] = len(pl.stalls)
        if out is None:
            ex = se.engine.executor
            if ex.acks_pending() or se.held_landings:
                # nothing to run but late acks to take: an idle round, no time
                pl.apply(Plan(pl.round), ex.idle_round())
                return
            if pl.waiting_on_peer():
                se.parked = True
                return
            se.stalled = True
            print(f"pdserve sim: {se.name} stalled at t={t0:.3f}s with {len(pl.requests)} "
                  f"live requests, {pl.free_pages()} free pages; marking them unfinished",
                  file=sys.stderr)
            for rid in list(pl.requests):
                if rid in self.records:
                    self.records[rid].error = "engine stalled: no admissible work"
            return
        self.rounds += 1
        now = se.clock
        plan = out.plan
        resident = len(pl.prefilling) + len(pl.running) + len(pl.landing) + len(pl.transferring)
        if resident > self.peak_resident:
            self.peak_resident = resident
        if se.role is not Role.PREFILL:
            for op in plan.prefills:
                if op.completes:
                    rec = self.records[op.req.id]
                    if rec.first_token_s is None:
                        rec.first_token_s = now
            self._finished(se, out.finished, now)
        lat = self.cfg.simulate.link_latency_s
        for op in plan.remote_prefills:
            self.counters["remote_prefills"] += 1
            r = op.req
            self._push(now + lat, "p_submit", se.index, r.peer, r.id, r.prompt, op.first_page,
                       r.adapter)
        for op in plan.remote_decodes:
            self._ship(se, op, now)
        if self.plan_log is not None:
            self._log_plan(se, t0, plan)

    def _land_due(self, d: SimEngine) -> None:
        """Deliver the held landings whose round has come (in arrival order)."""
        rounds = d.engine.executor.rounds
        due = [a for r, a in d.held_landings if r <= rounds]
        d.held_landings = [(r, a) for r, a in d.held_landings if r > rounds]
        for t, _, rid, token, p_idx in due:
            self._land(d, max(t, d.clock), rid, token, p_idx)

    def _ship(self, p: SimEngine, op, now: float) -> None:
        """Model P's KV write to D: one transfer at a time on P's link."""
        self.counters["transfers"] += 1
        start = max(now, p.link_free_at)
        busy = sum(len(pages) * b for pages, b in zip(op.src, self._page_bytes)) / self._link_bps
        p.link_free_at = start + busy
        end = start + busy + self.cfg.simulate.link_latency_s
        d_idx = op.req.peer
        if self._fault("transfer_fail", now, p.name):
            self.counters["transfer_failures"] += 1
            self._push(end, "failed", d_idx, op.req.id, p.index, f"transfer from {p.name} failed")
        else:
            self._push(end, "landed", d_idx, op.req.id, op.first_token, p.index)

    def _log_plan(self, se: SimEngine, t0: float, plan) -> None:
        def op(req_id, name, begin=0, tokens=0, replay=0):
            return {"req": req_id, "op": name, "begin": begin, "tokens": tokens,
                    "replay": replay}
        ops = [op(r.req.id, "retract") for r in plan.retracts]
        ops += [op(s.req_id, "store", tokens=len(s.device_pages)) for s in plan.stores]
        ops += [op(r.id, "readmit") for r in plan.readmits]
        ops += [op(ld.req_id, "load", tokens=len(ld.device_pages)) for ld in plan.loads]
        ops += [op(o.req.id, "prefill", o.begin, o.tokens, o.replay) for o in plan.prefills]
        ops += [op(r.id, "decode", r.num_tokens - 2, 1) for r in plan.decodes]
        ops += [op(o.req.id, "remote_prefill", o.first_page * se.planner.page_size,
                   o.req.prompt_len - o.first_page * se.planner.page_size)
                for o in plan.remote_prefills]
        ops += [op(o.req.id, "remote_decode", tokens=len(o.src_pages)) for o in plan.remote_decodes]
        pl = se.planner
        self.plan_log.write(json.dumps({
            "t": round(t0, 9), "engine": se.name, "role": se.role.value,
            "round": plan.round, "ops": ops, "free_pages": pl.free_pages(),
            "total_pages": pl.total_pages}) + "\n")

    # ---- the event loop --------------------------------------------------
    def run(self) -> dict:
        from tqdm import tqdm

        bar = tqdm(total=self.n, disable=not self.progress, unit="req",
                   desc="pdserve sim", file=sys.stderr)
        engines, events = self.engines, self._events
        watch = self.watch
        while watch is None or not watch.hopeless:
            busy = None
            for se in engines:
                if se.runnable() and (busy is None or se.clock < busy.clock):
                    busy = se
            if events and (busy is None or events[0][0] <= busy.clock):
                t, _, kind, args = heapq.heappop(events)
                self._deliver(t, kind, args)
            elif busy is not None:
                self._step(busy)
            else:
                break
            if self._done != bar.n:
                bar.update(self._done - bar.n)
        bar.close()
        return self.result()

    def result(self) -> dict:
        rows = [self.records[i].to_json() for i in self.order]
        end = max([e.clock for e in self.engines] + [0.0])
        hits = [se.engine.planner.hits for se in self.engines]
        tiers = {"prompt_tokens": sum(h.prompt_tokens for h in hits),
                 "device": sum(h.device_tokens for h in hits),
                 "host": sum(h.host_tokens for h in hits),
                 "disk": sum(h.disk_tokens for h in hits),
                 "disk_missed": sum(h.disk_missed for h in hits)}
        return {"requests": rows, "summary": summarize(rows, end),
                "counters": dict(self.counters), "cached_tokens_by_tier": tiers}
