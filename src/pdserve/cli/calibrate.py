"""`pdserve calibrate`: time the config's real engine over a grid of rounds
and fit a cost profile for `pdserve sim` (sim/calibrate/sweep.py does the work)."""

from __future__ import annotations

import argparse
import sys

from pdserve.benchmarks.common.options import positive


def add_arguments(p) -> None:
    p.add_argument("--config", required=True, help="config YAML (its model and engine)")
    p.add_argument("--out", required=True, help="where to write the profile YAML")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the config's model.device)")
    p.add_argument("--threads", type=positive,
                   help="torch intra-op threads (default: 1 on CPU, as a Ray engine runs)")
    p.add_argument("--chunks", type=positive, nargs="+",
                   help="prefill chunk sizes (default: page_size x 4^k up to "
                        "engine.max_scheduled_tokens)")
    p.add_argument("--batches", type=positive, nargs="+",
                   help="decode batch sizes (default: 4^k up to engine.max_batch_size, 64 "
                        "at most)")
    p.add_argument("--contexts", type=positive, nargs="+",
                   help="decode context lengths (default: 64 256 1024)")
    p.add_argument("--decode-rounds", type=positive, default=4,
                   help="pure decode rounds timed per batch and context (4)")
    p.add_argument("--seed", type=int, default=0, help="the prompts' random tokens")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time rounds by wall clock (default), or by the thread's CPU time "
                        "(CPU, one thread: leaves out time other processes held the core)")
    p.add_argument("--copies", type=positive, default=1,
                   help="after the fit, time the sweep again beside this many - 1 processes "
                        "sweeping the same grid, for the profile's neighbour_slowdown "
                        "(engines sharing a host's cores; default 1: alone)")
    p.add_argument("--served", action="store_true",
                   help="after the sweep, start the config's deployment, serve a generated "
                        "load through its router, and scale the profile to the rounds its "
                        "engines time (and fit neighbour_slowdown on them)")
    # the --copies processes sweep the grid as load beside the one measured
    p.add_argument("--as-load", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", help="also write every timed round (features, seconds) here "
                                    "as JSON lines")


def run(args) -> int:
    from pdserve.sim.calibrate.sweep import main as calibrate

    if args.served:
        given = [f"--{k}" for k in ("threads", "device") if getattr(args, k)]
        given += ["--copies"] * (args.copies > 1) + ["--clock cpu"] * (args.clock == "cpu")
        if given:
            print(f"pdserve calibrate: --served scales the sweep to the deployment's own "
                  f"engines, which take their device and threads from the config; drop "
                  f"{', '.join(given)}", file=sys.stderr)
            return 2
    return calibrate(config=args.config, out=args.out, device=args.device,
                     threads=args.threads, chunks=args.chunks, batches=args.batches,
                     contexts=args.contexts, decode_rounds=args.decode_rounds, seed=args.seed,
                     rounds_out=args.rounds, clock=args.clock, copies=args.copies,
                     as_load=args.as_load, served=args.served)
