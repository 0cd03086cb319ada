"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys

from pdserve.cli.subcommands import Subcommand, add_subcommands, chosen

# `pdserve CMD`: each module defines its options (`add_arguments`) and runs on
# them (`run`); only the chosen one is imported (see subcommands.py)
COMMANDS = [
    Subcommand("sim", "pdserve.cli.sim", "simulate a cluster on a request trace (virtual time)"),
    Subcommand("calibrate", "pdserve.cli.calibrate",
               "time the config's real engine over a grid of rounds and fit a cost profile "
               "for `pdserve sim`"),
    Subcommand("up", "pdserve.cli.up",
               "start a deployment (local Ray cluster, or join one) and serve"),
    Subcommand("drain", "pdserve.cli.drain",
               "drain one engine: it takes no new request, finishes what it holds, then stops"),
    Subcommand("stats", "pdserve.cli.stats", "per-engine pages and requests of a deployment"),
    Subcommand("plan", "pdserve.cli.plan",
               "search P:D splits and chunk budgets by simulation for the most goodput per "
               "GPU within a latency SLO"),
    Subcommand("demo", "pdserve.cli.demo",
               "a local 1P+1D cluster on SmolLM2-135M-Instruct, a few concurrent questions, "
               "streamed answers, stats"),
    Subcommand("generate", "pdserve.cli.generate",
               "generate text: from a running deployment (--address) or offline in-process "
               "(--config)"),
    Subcommand("bench", "pdserve.cli.bench",
               "benchmarks that print a table; each has its own options: pdserve bench NAME "
               "--help"),
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    add_subcommands(ap, COMMANDS, dest="cmd")
    return ap


def main(argv=None) -> int:
    from pdserve.sim.trace import TraceError
    from pdserve.scheduler.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return chosen(COMMANDS, args.cmd).run(args)
    except (ConfigError, TraceError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
