"""`pdserve plan`: search P:D splits and chunk budgets by simulation for the
most goodput per GPU within a latency SLO; the table is printed and plan.yaml,
plan.json and plan.png written to --out (sim/plan_search.py searches,
sim/plan_report.py renders)."""

from __future__ import annotations

from pdserve.benchmarks.args import positive


def add_arguments(p) -> None:
    p.add_argument("--config", required=True, help="base config YAML (its simulate: section "
                                                   "and engine settings)")
    p.add_argument("--trace", required=True,
                   help="trace JSONL (ours or Mooncake) or Azure CSV, replayed open loop")
    p.add_argument("--ttft", type=float, required=True, help="time-to-first-token SLO, s")
    p.add_argument("--tpot", type=float, required=True, help="time-per-output-token SLO, s")
    p.add_argument("--gpus", type=int, required=True, help="engines to plan, one GPU each")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="fraction of requests that must meet both SLOs (0.9)")
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    p.add_argument("--chunks", type=int, nargs="+",
                   help="engine.max_scheduled_tokens values to try (2048 8192)")
    p.add_argument("--tolerance", type=float,
                   help="stop a bisection when its failing rate is within this fraction "
                        "of its passing rate (0.1)")
    p.add_argument("--address", help="run the simulations on this Ray cluster (default: a "
                                     "local Ray on every core)")
    p.add_argument("--cpus", type=positive, help="simulations at once: a local Ray's "
                                                  "CPUs (default: every core; with "
                                                  "--address, the cluster's CPUs)")
    p.add_argument("--in-process", action="store_true",
                   help="run the simulations here, one at a time, without Ray")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", required=True, help="folder for plan.yaml, plan.json, plan.png")


def run(args) -> int:
    from pdserve.sim.plan_report import command

    return command(args)
