"""How many torch (OpenMP) threads a CPU engine runs: `engine.cpu_threads`.

Ray gives an actor that takes no CPUs `OMP_NUM_THREADS=1` unless the
environment already sets it, and engines are such actors (cluster/actors.py),
so a served CPU engine has always run one thread, while `pdserve.LLM` in a
process of its own runs torch's default (every core). That difference, not
the router, is most of what separated a served stream's inter-token latency
from the offline engine's in earlier measurements (docs/benchmarks.md,
issue 40). The count is now the config's, said at load:

- `engine.cpu_threads: N` (N > 0): N threads. On a host of its own, two
  threads made SmolLM2-135M's bfloat16 decode step about 1.5x faster than
  one (it is bound by reading the weights, and one core reads at half the
  rate two do);
- `0` (auto): one thread, what Ray gave. OpenMP's threads wait for each
  other at every operator, so where other processes take the cores (a
  shared CI host, a router and clients beside the engine) a forward of two
  threads took 5-15x one's (0.25-1.3 s against 60-80 ms for the same
  step): more threads pay only on cores the engine has to itself;
- an `OMP_NUM_THREADS` in the driver's own environment wins over both, as
  it did before (and as the malloc settings beside it do).

pdserve's own C kernels (kernels/cpu/pool.c) share their work differently:
the engine's thread takes every piece no helper has claimed, so a helper
that is not running costs nothing and one that runs takes a core's idle
time. They share among `engine.cpu_threads` threads where it is set, and
by default among every core the engine's process may run on
(`kernel_workers`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.config import ServeConfig

ENV = "OMP_NUM_THREADS"


def engine_threads(cfg: ServeConfig, role: str) -> int:
    """The torch threads `role`'s engines run (see the module's rules, the
    driver's environment aside)."""
    from pdserve.config import role_engine

    return role_engine(cfg, role).cpu_threads or 1


def served_threads(cfg: ServeConfig, role: str) -> int:
    """The threads a served engine of `role` runs, the driver's environment
    included (what an offline comparison should run)."""
    return int(os.environ[ENV]) if os.environ.get(ENV, "").isdigit() else \
        engine_threads(cfg, role)


def thread_env(cfg: ServeConfig, role: str) -> dict[str, str]:
    """The environment a CPU engine's process starts with: its thread count,
    unless the driver's environment sets one."""
    if ENV in os.environ:
        return {}
    return {ENV: str(engine_threads(cfg, role))}


def kernel_workers(cpu_threads: int) -> int:
    """The threads pdserve's C kernels share a job among, for an engine
    whose `engine.cpu_threads` is `cpu_threads`: that many where set, else
    every core this process may run on."""
    return cpu_threads or len(os.sched_getaffinity(0))


def share_kernel_cores(cpu_threads: int) -> int:
    """Start the C kernels' helpers for this engine process (`kernel_workers`);
    returns how many threads share their work (1 where they do not run)."""
    from pdserve.kernels.cpu.native import share_cores

    return share_cores(kernel_workers(cpu_threads))
