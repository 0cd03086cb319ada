"""`pdserve sim`: a simulated cluster replays a request trace in virtual time;
the result JSON is written and its summary printed."""

from __future__ import annotations

import json
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--config", required=True, help="config YAML")
    p.add_argument("--trace", required=True, help="trace JSONL (ours or Mooncake) or Azure CSV")
    p.add_argument("--out", required=True, help="where to write the result JSON")
    p.add_argument("--plans", help="also write one JSON line per engine round here")
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--faults", help="YAML list of faults to inject (see docs/configuration.md)")
    p.add_argument("--strict", action="store_true",
                   help="admit every request strictly (its whole generation reserved)")


def run(args) -> int:
    from pdserve.config import load_config
    from pdserve.sim.fault_plan import load_faults
    from pdserve.sim.simulation import Simulation, build_engines, format_summary
    from pdserve.sim.trace import read_trace

    cfg = load_config(args.config)
    trace = read_trace(args.trace, limit=args.limit)
    faults = []
    if args.faults:
        faults = load_faults(args.faults, [e.name for e in build_engines(cfg)])
    plan_log = None
    if args.plans:
        Path(args.plans).parent.mkdir(parents=True, exist_ok=True)
        plan_log = open(args.plans, "w")
    started = time.perf_counter()
    try:
        sim = Simulation(cfg, trace, plan_log=plan_log, progress=not args.no_progress,
                         all_strict=args.strict, faults=faults)
        result = sim.run()
    finally:
        if plan_log is not None:
            plan_log.close()
    wall = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"pdserve sim: {len(trace)} requests on {len(sim.engines)} engine(s), "
          f"{sim.rounds} rounds, {wall:.1f} s wall; results in {out}")
    print(format_summary(result["summary"]))
    if any(result["counters"].values()):
        print(" ".join(f"{k}={v}" for k, v in result["counters"].items() if v))
    return 0
