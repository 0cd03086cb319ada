"""`pdserve plan`: search P:D splits and chunk budgets by simulation for the
most goodput per GPU within a latency SLO; the table is printed and plan.yaml,
plan.json and plan.png written to --out (sim/plan/search.py searches,
sim/plan/report.py renders). With several --tpot values or --prompt-len,
a map of where P/D beats fused instead (sim/plan/map.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from pdserve.benchmarks.common.options import positive


def add_arguments(p) -> None:
    p.add_argument("--config", required=True, help="base config YAML (its simulate: section "
                                                   "and engine settings)")
    p.add_argument("--trace", required=True,
                   help="trace JSONL (ours or Mooncake) or Azure CSV, replayed open loop")
    p.add_argument("--ttft", type=float, required=True, help="time-to-first-token SLO, s")
    p.add_argument("--tpot", type=float, nargs="+", required=True,
                   help="time-per-output-token SLO, s; several (or --prompt-len) map where "
                        "P/D beats fused instead of planning one")
    p.add_argument("--gpus", type=int, required=True, help="engines to plan, one GPU each")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="fraction of requests that must meet both SLOs (0.9)")
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")
    p.add_argument("--prompt-len", type=int, nargs="+",
                   help="map where P/D beats fused with the trace's prompts cut at each of "
                        "these token counts (and each --tpot): the best fused engines and the "
                        "best P:D split on --gpus, searched apart, written to --out as "
                        "map.md and map.json")
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
    from pdserve.config import load_config
    from pdserve.scheduler.config import ConfigError
    from pdserve.sim.plan.search import (DEFAULT_CHUNKS, DEFAULT_TOLERANCE, Settings,
                                         check_settings)
    from pdserve.sim.report import Slo
    from pdserve.sim.trace import TraceError, read_trace

    tpots = list(dict.fromkeys(args.tpot))
    mapped = len(tpots) > 1 or bool(args.prompt_len)
    settings = Settings(Slo(args.ttft, tpots[0]), args.attainment, args.gpus,
                        tuple(dict.fromkeys(args.chunks or DEFAULT_CHUNKS)),
                        DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}: how many requests "
                          "from the start of the trace to plan for")
    base_path = Path(args.config)
    base = load_config(base_path)
    for tpot in tpots[1:]:              # each SLO checked as the first is
        check_settings(dataclasses.replace(settings, slo=Slo(args.ttft, tpot)), base)
    for note in check_settings(settings, base):
        print(f"pdserve plan: {note}", file=sys.stderr)
    if mapped and args.gpus < 2:
        raise ConfigError(f"several --tpot or --prompt-len values map where P/D beats fused "
                          f"on the same GPUs, and --gpus {args.gpus} allows no P:D split; "
                          "give --gpus 2 or more")
    bad = [n for n in args.prompt_len or [] if n < 1]
    if bad:
        raise ConfigError(f"--prompt-len {bad[0]} must be at least 1: the tokens each prompt "
                          "is cut at")
    if not Path(args.trace).is_file():
        raise TraceError(f"trace file {args.trace!r} does not exist; pass --trace with a "
                         "JSONL trace (ours or Mooncake's) or an Azure CSV")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for plan.yaml, plan.json "
                          "and plan.png")
    trace = read_trace(args.trace, limit=args.limit)
    tasks, pool_for, width = _pools(args, settings)
    settings = dataclasses.replace(settings, width=width)
    try:
        if mapped:
            return _run_map(args, base, trace, settings, tpots, pool_for, out)
        return _run_plan(args, base_path, base, trace, settings, pool_for(trace, settings.slo),
                         out)
    finally:
        if tasks is not None:
            tasks.close()


def _pools(args, settings):
    """(the Ray tasks to close at the end or None, pool_for(trace, slo), the
    probes a search keeps in flight): probes here one at a time
    (--in-process), or on Ray tasks started once for every search."""
    from pdserve.cluster.probe_pool import RayTasks
    from pdserve.sim.plan.probe import InProcess, OnTasks, local_cpus

    if args.in_process:
        width = args.cpus or local_cpus()
        return None, lambda trace, slo: InProcess(trace, slo, settings.attainment, width), width
    tasks = RayTasks(args.address, args.cpus or local_cpus())
    return tasks, lambda trace, slo: OnTasks(tasks, trace, slo, settings.attainment), \
        args.cpus or tasks.width


def _run_map(args, base, trace, settings, tpots, pool_for, out: Path) -> int:
    import json

    from pdserve.sim.plan.map import format_map, map_json, plan_map

    lens = list(dict.fromkeys(args.prompt_len)) if args.prompt_len else [None]
    print(f"pdserve plan: where P/D beats fused on {settings.gpus} GPUs; {len(trace)} "
          f"requests, {settings.attainment:.0%} within TTFT <= {settings.slo.ttft_s:g} s and "
          f"each TPOT SLO; {len(lens) * len(tpots)} cells, two searches each")
    cells = plan_map(base, trace, settings, lens, tpots, pool_for,
                     progress=not args.no_progress)
    table = format_map(cells)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "map.json").write_text(json.dumps(map_json(cells, settings.gpus, args.trace),
                                             indent=1) + "\n")
    (out / "map.md").write_text(table + "\n")
    print(f"map: {out / 'map.md'}, {out / 'map.json'}")
    return 0


def _run_plan(args, base_path: Path, base, trace, settings, pool, out: Path) -> int:
    import json

    from pdserve.sim.plan.report import format_table, plan_json, plan_yaml, plot
    from pdserve.sim.plan.search import make_plan

    result = make_plan(base, trace, settings, pool, progress=not args.no_progress)
    probes = [p for b in result.brackets for p in b.probes]
    print(f"pdserve plan: {result.requests} requests ({result.native_rate:.2f} req/s as "
          f"traced), {settings.attainment:.0%} within TTFT <= {settings.slo.ttft_s:g} s and "
          f"TPOT <= {settings.slo.tpot_s * 1000:g} ms, {settings.gpus} GPUs; {len(probes)} "
          f"simulations ({sum(p.cpu_s for p in probes):.0f} CPU-s) in {result.wall_s:.0f} s")
    print(format_table(result))
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan_json(result, args.trace), indent=1) + "\n")
    if plot(result, out / "plan.png"):
        print(f"plot: {out / 'plan.png'}")
    best = result.best
    if best is None:
        closest = max((p for b in result.brackets for p in b.probes),
                      key=lambda p: p.attainment)
        print(f"pdserve plan: error: no candidate met the SLO for {settings.attainment:.0%} "
              f"of requests at any rate tried (best: {closest.attainment:.1%} at "
              f"{closest.rate_req_s:.2f} req/s); loosen --ttft/--tpot, lower --attainment, "
              f"or add --gpus. Probes are in {out / 'plan.json'}", file=sys.stderr)
        return 1
    (out / "plan.yaml").write_text(plan_yaml(base_path, result, args.trace))
    c, lo = best.candidate, best.lo
    assert lo is not None                   # `best` is a bracket with a passing probe
    print(f"best: {c.shape}, chunk {c.chunk}: {lo.rate_req_s:.2f} req/s "
          f"({lo.rate_req_s / settings.gpus:.3f} per GPU); config in {out / 'plan.yaml'}")
    return 0
