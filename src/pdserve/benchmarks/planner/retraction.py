"""A tight pool three ways, side by side: optimistic admission with the host
cache off, with it on, and every request strict (the banker's scheme)."""

from __future__ import annotations

import argparse
import dataclasses
import time

from pdserve.benchmarks.common.options import sim_arguments, usage_error
from pdserve.benchmarks.common.tables import ms
from pdserve.config import load_config
from pdserve.sim.simulation import Simulation
from pdserve.sim.report import goodput
from pdserve.sim.trace import read_trace

TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.1


def main(config_path: str, trace_path: str, limit: int | None = None) -> int:
    cfg = load_config(config_path)
    trace = read_trace(trace_path, limit=limit)
    host = cfg.engine.host_pages or 4 * cfg.engine.total_pages
    runs = [
        ("optimistic, no host cache", dataclasses.replace(cfg.engine, host_pages=0), False),
        (f"optimistic, host cache {host} pages", dataclasses.replace(cfg.engine, host_pages=host),
         False),
        ("every request strict", dataclasses.replace(cfg.engine, host_pages=0), True),
    ]
    rows = []
    for name, engine, strict in runs:
        t0 = time.perf_counter()
        sim = Simulation(dataclasses.replace(cfg, engine=engine), trace, progress=False,
                         all_strict=strict)
        res = sim.run()
        s = res["summary"]
        rows.append((name, s, sum(r["retractions"] for r in res["requests"]),
                     goodput(res, TTFT_SLO_S, TPOT_SLO_S), time.perf_counter() - t0))
    e = cfg.engine
    print(f"{len(trace)} requests, {cfg.cluster.fused} fused engines x {e.total_pages} pages "
          f"of {e.page_size}, safe_steps={e.safe_steps}; goodput: finished req/s with "
          f"TTFT <= {TTFT_SLO_S:g} s and TPOT <= {TPOT_SLO_S * 1000:g} ms")
    print(f"{'admission':<36} {'finished':>8} {'unfin.':>6} {'retract':>7} {'goodput':>8} "
          f"{'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'wall s':>6}")
    for name, s, retr, good, wall in rows:
        print(f"{name:<36} {s['finished']:>8} {s['unfinished']:>6} {retr:>7} {good:>8.3f} "
              f"{s['output_tok_per_s']:>7.0f} {ms(s['ttft_p50_s']):>9} {ms(s['ttft_p99_s']):>9} "
              f"{ms(s['tpot_p50_s']):>9} {ms(s['tpot_p99_s']):>9} {wall:>6.0f}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    sim_arguments(p)


def run(args) -> int:
    if not args.config or not args.trace:
        return usage_error("bench retraction needs --config and --trace")
    return main(args.config, args.trace, limit=args.limit)
