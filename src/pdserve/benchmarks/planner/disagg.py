"""Fused against disaggregated splits of the same GPUs, across request rates.

Every configuration gets the same engine settings and the same trace, with
arrival times scaled to each rate; goodput counts finished requests a second
that met both SLOs (TTFT and TPOT), as DistServe reports it. Prints a table,
saves JSON, and draws goodput against rate as a PNG when matplotlib is
installed (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from pdserve.benchmarks.common.options import sim_arguments, usage_error
from pdserve.benchmarks.common.tables import s_or_ms
from pdserve.config import ClusterShape, load_config
from pdserve.sim.simulation import Simulation
from pdserve.sim.report import goodput, plot_lines
from pdserve.sim.trace import native_rate, read_trace, scale_arrivals

SPLITS = {"fused x4": (0, 0, 4), "2P+2D": (2, 2, 0), "1P+3D": (1, 3, 0), "3P+1D": (3, 1, 0)}


def main(config_path: str, trace_path: str, limit: int | None, rates: list[float],
         ttft_slo: float, tpot_slo: float, out: str | None, plot: str | None) -> int:
    base = load_config(config_path)
    trace = read_trace(trace_path, limit=limit)
    native = native_rate(trace)
    rows = []
    for name, (p, d, f) in SPLITS.items():
        cfg = dataclasses.replace(base, cluster=ClusterShape(prefill=p, decode=d, fused=f))
        for factor in rates:
            t0 = time.perf_counter()
            res = Simulation(cfg, scale_arrivals(trace, factor), progress=False).run()
            s = res["summary"]
            rows.append({"config": name, "rate_req_s": native * factor, "factor": factor,
                         "finished": s["finished"], "ttft_p50_s": s["ttft_p50_s"],
                         "ttft_p99_s": s["ttft_p99_s"], "tpot_p50_s": s["tpot_p50_s"],
                         "tpot_p99_s": s["tpot_p99_s"],
                         "goodput_req_s": goodput(res, ttft_slo, tpot_slo),
                         "wall_s": time.perf_counter() - t0})
    print(f"{len(trace)} requests; native rate {native:.2f} req/s; SLO TTFT <= {ttft_slo:g} s, "
          f"TPOT <= {tpot_slo * 1000:g} ms; {base.simulate.model} on {base.simulate.gpu}")
    print(f"{'config':<9} {'req/s':>6} {'fin':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'goodput':>8}")
    for r in rows:
        print(f"{r['config']:<9} {r['rate_req_s']:>6.2f} {r['finished']:>5} "
              f"{s_or_ms(r['ttft_p50_s']):>9} {s_or_ms(r['ttft_p99_s']):>9} "
              f"{s_or_ms(r['tpot_p50_s'], True):>9} {s_or_ms(r['tpot_p99_s'], True):>9} "
              f"{r['goodput_req_s']:>8.3f}")
    if out:
        Path(out).write_text(json.dumps(rows, indent=1) + "\n")
    if plot:
        _plot(rows, plot, ttft_slo, tpot_slo)
    return 0


def _plot(rows, path: str, ttft_slo: float, tpot_slo: float) -> None:
    lines = {name: ([r["rate_req_s"] for r in rows if r["config"] == name],
                    [r["goodput_req_s"] for r in rows if r["config"] == name])
             for name in SPLITS}
    if plot_lines(path, lines, "request rate (req/s)",
                  f"goodput (req/s, TTFT<={ttft_slo:g}s, TPOT<={tpot_slo * 1000:g}ms)",
                  "Mooncake conversation trace, 4 simulated GPUs"):
        print(f"plot: {path}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sim_arguments(p)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0],
                   help="arrival-rate multipliers of the trace's own rate")
    p.add_argument("--ttft-slo", type=float, default=2.0,
                   help="time to first token a request must meet to count, seconds (2)")
    p.add_argument("--tpot-slo", type=float, default=0.1,
                   help="time per output token a request must meet to count, seconds (0.1)")
    p.add_argument("--out", help="save the results as JSON here")
    p.add_argument("--plot", help="draw goodput against rate into this PNG")


def run(args) -> int:
    if not args.config or not args.trace:
        return usage_error("bench disagg needs --config and --trace")
    return main(args.config, args.trace, args.limit, args.rates, args.ttft_slo, args.tpot_slo,
                args.out, args.plot)
