"""One probe of `pdserve plan`, and where probes run.

A probe is one simulation of a candidate at a rate factor, watched so that
it stops once the SLO attainment is out of reach. A pool starts probes
(`submit`) and hands back each one's result (`result`): `InProcess` runs
them here one after another; `OnTasks` hands them to a task runner
(`cluster/probe_pool.RayTasks`: Ray tasks, one CPU each).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from pdserve.config import ServeConfig
from pdserve.sim.simulation import Simulation
from pdserve.sim.report import Slo, SloWatch, percentile
from pdserve.sim.trace import TraceRequest, native_rate, scale_arrivals


@dataclass(frozen=True)
class Probe:
    """One simulation at `factor` x the trace's arrival rate."""
    factor: float
    rate_req_s: float
    passed: bool
    # met / requests; stopped early, met / decided (finished or certainly
    # missed by then): how the part it simulated went
    attainment: float
    stopped_early: bool     # the target became unreachable before the trace ended
    finished: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    wall_s: float = field(default=0.0, compare=False)
    cpu_s: float = field(default=0.0, compare=False)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        del d["wall_s"], d["cpu_s"]           # plan.json is the same on every run
        return d


def run_probe(cfg: ServeConfig, trace: list[TraceRequest], factor: float, slo: Slo,
              target: float) -> Probe:
    started, cpu = time.perf_counter(), time.process_time()
    watch = SloWatch(slo, target, len(trace))
    res = Simulation(cfg, scale_arrivals(trace, factor), progress=False, watch=watch).run()
    fin = [r for r in res["requests"] if r["status"] == "finished"]
    ttft = [r["ttft_s"] for r in fin]
    tpot = [r["tpot_s"] for r in fin if r["tpot_s"] is not None]
    n = len(trace)
    stopped = watch.hopeless
    met = sum(1 for r in res["requests"] if slo.met(r))
    return Probe(factor=factor, rate_req_s=factor * native_rate(trace),
                 passed=not stopped and met >= watch.need,
                 attainment=met / (met + len(watch.missed)) if stopped else met / n,
                 stopped_early=stopped, finished=len(fin),
                 ttft_p50_s=percentile(ttft, 0.5), ttft_p90_s=percentile(ttft, 0.9),
                 tpot_p50_s=percentile(tpot, 0.5), tpot_p90_s=percentile(tpot, 0.9),
                 wall_s=time.perf_counter() - started, cpu_s=time.process_time() - cpu)


# ---- where probes run ----------------------------------------------------------

class InProcess:
    """Every probe here, one after another, when its result is asked for
    (tests, debugging)."""

    def __init__(self, trace, slo: Slo, target: float, width: int = 1):
        self.trace, self.slo, self.target = trace, slo, target
        self.width = width          # plans as if this many CPUs ran probes at once

    def submit(self, cfg: ServeConfig, factor: float):
        return cfg, factor

    def result(self, handle) -> Probe:
        cfg, factor = handle
        return run_probe(cfg, self.trace, factor, self.slo, self.target)

    def close(self) -> None:
        pass


class OnTasks:
    """Probes on a task runner (`cluster/probe_pool.RayTasks`: Ray tasks, one
    CPU each), the trace stored once for all of them."""

    def __init__(self, tasks, trace, slo: Slo, target: float):
        self.tasks, self.slo, self.target = tasks, slo, target
        self._trace = tasks.put(trace)
        self.width = tasks.width

    def submit(self, cfg: ServeConfig, factor: float):
        return self.tasks.submit(run_probe, cfg, self._trace, factor, self.slo, self.target)

    def result(self, handle) -> Probe:
        return self.tasks.result(handle)

    def close(self) -> None:
        self.tasks.close()


def local_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # type: ignore[return-value]
