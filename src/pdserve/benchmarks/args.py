"""Options more than one command shares: argument types, option groups two
benchmarks define alike, the API key of a command that calls a router, and
the usage error. The `pdserve` command imports them from here; no benchmark
imports the command (the model flags, which `bench serve` shares with `up`,
are cli/model_flags.py, a leaf that imports only the config)."""

from __future__ import annotations

import argparse
import os
import sys


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def non_negative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return n


def workload_arguments(p: argparse.ArgumentParser) -> None:
    """Synthetic requests sent to a deployment (serve, sim-accuracy)."""
    p.add_argument("--requests", type=int, default=64, help="how many (64)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each synthetic prompt (128)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (64)")


def sim_arguments(p: argparse.ArgumentParser) -> None:
    """A simulated deployment replaying a trace (disagg, retraction)."""
    p.add_argument("--config", help="config YAML of the simulated deployment")
    p.add_argument("--trace", help="trace JSONL (ours or Mooncake) or Azure CSV")
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")


def usage_error(message: str) -> int:
    """A combination of options argparse cannot check: said, exit status 2."""
    print(f"pdserve: error: {message}", file=sys.stderr)
    return 2


def client_key_argument(p: argparse.ArgumentParser) -> None:
    """--api-key for a command that calls a running deployment's router."""
    p.add_argument("--api-key", default=None,
                   help="the deployment's API key, if it was started with one (default "
                        "$PDSERVE_API_KEY)")


def client_key(args) -> str | None:
    return args.api_key or os.environ.get("PDSERVE_API_KEY") or None
