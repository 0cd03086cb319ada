"""`pdserve sim`: a cluster of engines on virtual time, driven by a trace.

Each engine is the real planner behind a `SimExecutor`. A discrete-event
loop always advances whichever comes first, the next arrival or the busy
engine with the earliest clock; ties go to the lower engine index, so a run
is a pure function of trace and config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.trace import TraceRequest
from pdserve.roles.cost_model import GPUS, MODELS, CostModel, preset
from pdserve.roles.engine import Engine
from pdserve.roles.sim_executor import SimExecutor
from pdserve.scheduler.config import ConfigError
from pdserve.scheduler.planner import Planner, RejectedRequest
from pdserve.scheduler.request import Request, SamplingLimits


@dataclass
class Record:
    id: str
    arrival_s: float
    status: str = "unfinished"
    error: str | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    retractions: int = 0

    def to_json(self) -> dict:
        ttft = e2e = tpot = None
        if self.first_token_s is not None:
            ttft = self.first_token_s - self.arrival_s
        if self.finish_s is not None and self.status == "finished":
            e2e = self.finish_s - self.arrival_s
            if self.output_tokens > 1:
                tpot = (self.finish_s - self.first_token_s) / (self.output_tokens - 1)
        return {"id": self.id, "status": self.status, "error": self.error,
                "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
                "output_tokens": self.output_tokens, "retractions": self.retractions}


@dataclass
class SimEngine:
    engine: Engine
    index: int
    load: int = 0                 # outstanding tokens routed here and not finished
    stalled: bool = False
    live: dict = field(default_factory=dict)   # req id -> routed load

    @property
    def clock(self) -> float:
        return self.engine.executor.now


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def build_engines(cfg: ServeConfig) -> list[SimEngine]:
    model = preset(MODELS, "model", cfg.simulate.model)
    gpu = preset(GPUS, "gpu", cfg.simulate.gpu)
    engine_cfg = cfg.engine
    if "max_context_tokens" not in cfg.engine_overrides:
        engine_cfg = dataclasses.replace(engine_cfg, max_context_tokens=model.context)
    if cfg.cluster.fused == 0:
        raise ConfigError(
            "pdserve sim runs fused engines for now (cluster.fused >= 1); the "
            "prefill/decode split arrives with the P/D roles")
    cost = CostModel(model, gpu)
    return [SimEngine(Engine(f"fused-{i}", Planner(engine_cfg),
                             SimExecutor(cost, engine_cfg.page_size)), i)
            for i in range(cfg.cluster.fused)]


class Simulation:
    def __init__(self, cfg: ServeConfig, trace: list[TraceRequest], plan_log=None,
                 progress: bool = True, all_strict: bool = False):
        self.cfg = cfg
        self.all_strict = all_strict
        self.engines = build_engines(cfg)
        self.trace = sorted(enumerate(trace), key=lambda it: (it[1].arrival_s, it[0]))
        self.records = {t.id: Record(t.id, t.arrival_s) for t in trace}
        self.order = [t.id for t in trace]
        self.plan_log = plan_log
        self.progress = progress
        self.rounds = 0
        self._stalls_seen: dict[int, int] = {}

    # ---- routing ---------------------------------------------------------
    def _route(self, t: TraceRequest) -> None:
        rec = self.records[t.id]
        target = min(self.engines, key=lambda e: (e.load, e.index))
        if not target.engine.has_work():
            target.engine.executor.now = max(target.clock, t.arrival_s)
        req = Request(t.id, t.prompt, SamplingLimits(max_new_tokens=t.max_new_tokens,
                                                     strict=t.strict or self.all_strict))
        try:
            target.engine.submit(req, t.output_tokens)
        except RejectedRequest as e:
            rec.status, rec.error = "rejected", str(e)
            return
        load = req.prompt_len + req.max_new_tokens
        target.live[t.id] = load
        target.load += load

    # ---- one engine round ------------------------------------------------
    def _step(self, se: SimEngine) -> None:
        t0 = se.clock
        out = se.engine.step()
        if out is None:
            # Nothing could be built while requests wait: without retraction a
            # pool held by requests that outgrew their reserve cannot move.
            se.stalled = True
            pl = se.engine.planner
            print(f"pdserve sim: {se.engine.name} stalled at t={t0:.3f}s with "
                  f"{len(pl.requests)} live requests, {pl.free_pages()} free pages; "
                  "marking them unfinished", file=sys.stderr)
            for rid in list(pl.requests):
                self.records[rid].error = "engine stalled: no admissible work"
            return
        self.rounds += 1
        pl = se.engine.planner
        for msg in pl.stalls[self._stalls_seen.get(se.index, 0):]:
            print(f"pdserve sim: {se.engine.name}: liveness last resort: {msg}", file=sys.stderr)
        self._stalls_seen[se.index] = len(pl.stalls)
        now = se.clock
        plan = out.plan
        for op in plan.prefills:
            if op.completes:
                rec = self.records[op.req.id]
                if rec.first_token_s is None:
                    rec.first_token_s = now
        for req in out.finished:
            rec = self.records[req.id]
            rec.status = "finished"
            rec.finish_s = now
            rec.output_tokens = len(req.output)
            rec.retractions = req.retractions
            se.load -= se.live.pop(req.id)
            self._done += 1
        if self.plan_log is not None:
            self._log_plan(se, t0, plan)

    def _log_plan(self, se: SimEngine, t0: float, plan) -> None:
        ops = [{"req": r.req.id, "op": "retract", "begin": 0, "tokens": 0, "replay": 0}
               for r in plan.retracts]
        ops += [{"req": s.req_id, "op": "store", "begin": 0, "tokens": len(s.device_pages),
                 "replay": 0} for s in plan.stores]
        ops += [{"req": r.id, "op": "readmit", "begin": 0, "tokens": 0, "replay": 0}
                for r in plan.readmits]
        ops += [{"req": ld.req_id, "op": "load", "begin": 0, "tokens": len(ld.device_pages),
                 "replay": 0} for ld in plan.loads]
        ops += [{"req": op.req.id, "op": "prefill", "begin": op.begin, "tokens": op.tokens,
                 "replay": op.replay} for op in plan.prefills]
        ops += [{"req": r.id, "op": "decode", "begin": r.num_tokens - 2, "tokens": 1,
                 "replay": 0} for r in plan.decodes]
        pl = se.engine.planner
        self.plan_log.write(json.dumps({
            "t": round(t0, 9), "engine": se.engine.name, "role": se.engine.role,
            "round": plan.round, "ops": ops, "free_pages": pl.free_pages(),
            "total_pages": pl.total_pages}) + "\n")

    # ---- the event loop --------------------------------------------------
    def run(self) -> dict:
        from tqdm import tqdm

        bar = tqdm(total=len(self.trace), disable=not self.progress, unit="req",
                   desc="pdserve sim", file=sys.stderr)
        self._done = 0
        i, n = 0, len(self.trace)
        engines = self.engines
        while True:
            busy = None
            for se in engines:
                if not se.stalled and se.engine.has_work() and \
                        (busy is None or se.clock < busy.clock):
                    busy = se
            if i < n and (busy is None or self.trace[i][1].arrival_s <= busy.clock):
                self._route(self.trace[i][1])
                i += 1
                continue
            if busy is None:
                break
            before = self._done
            self._step(busy)
            if self._done != before:
                bar.update(self._done - before)
        bar.close()
        return self.result()

    def result(self) -> dict:
        recs = [self.records[i] for i in self.order]
        rows = [r.to_json() for r in recs]
        fin = [r for r in rows if r["status"] == "finished"]
        end = max([e.clock for e in self.engines] + [0.0])
        out_tokens = sum(r["output_tokens"] for r in fin)
        ttft = [r["ttft_s"] for r in fin]
        tpot = [r["tpot_s"] for r in fin if r["tpot_s"] is not None]
        count = {s: sum(1 for r in rows if r["status"] == s)
                 for s in ("finished", "rejected", "failed", "unfinished")}
        summary = dict(count)
        summary.update({
            "virtual_seconds": end,
            "output_tok_per_s": out_tokens / end if end > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        })
        return {"requests": rows, "summary": summary}


def goodput(result: dict, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Finished requests a second that met both SLOs (DistServe's goodput)."""
    ok = sum(1 for r in result["requests"] if r["status"] == "finished"
             and r["ttft_s"] <= ttft_slo_s and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo_s))
    secs = result["summary"]["virtual_seconds"]
    return ok / secs if secs > 0 else 0.0


def format_summary(summary: dict) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4f}"
        return str(v)
    width = max(len(k) for k in summary)
    return "\n".join(f"{k:<{width}}  {fmt(v)}" for k, v in summary.items())
