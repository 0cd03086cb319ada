"""`pdserve calibrate --served`: the sweep's cost profile, scaled to the
rounds a running deployment times while it serves.

The sweep (sim/calibrate/sweep.py) times the engine in a process of its own.
A serving engine shares its process with its gRPC server and output thread,
and its host with the router, the client and the other engines. On the
2-core machine its lone rounds ran 10-18% longer than the sweep's with the
same features, so a simulator priced by the sweep ran fast at every load.

This mode runs the sweep it is given (`calibrate`'s, the form's shape: its
grid varies one feature at a time; given, so this module does not import
the one that dispatches to it), then starts the config's deployment, drives closed-loop loads
through its router (`LOADS`: lone prefills at several contexts, lone
decodes, batches of growing size) and takes the rounds each engine timed,
with the same features and clock, plus each round's wall-clock start, from
which it counts the other engines computing as each round began (n). Two
numbers are fitted on them (`fit_serving`): a scale for the whole form and
`neighbour_slowdown` k, so a served round costs scale x form x (1 + k n).
Then, per round kind, decode-batch bucket and alone/beside others, the
median served round against that scaled form (`fit_factors`): the
profile's `served_factors`, which the simulator applies where a cell had
enough rounds. Every 4th served round is held out, and its error is
reported with the table and with the scale and k alone. The loads differ
from `bench sim-accuracy`'s (their prompt and output lengths), so that
benchmark checks the profile on requests it was not fitted to.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable

from pdserve.sim.cost.profile import Profile, Round, RoundCost, neighbours

# calibrate(cfg, grid_args, *, seed, progress, source) -> (profile, rounds, report):
# sim/calibrate/sweep.py's sweep
Sweep = Callable[..., tuple[Profile, list[Round], dict]]

# (concurrency, prompt tokens, output tokens, requests), each a closed loop
LOADS = ((1, 48, 48, 4), (1, 512, 4, 3), (1, 1000, 4, 2),
         (4, 200, 48, 8), (16, 96, 48, 32), (48, 40, 32, 48))
MIN_ROUNDS = 40          # served rounds, at least, to fit the scale on


def served_rounds(dep, loads, seed: int, say) -> tuple[list[Round], list[int]]:
    """Drive `loads` through the started deployment `dep`; every round its
    engines timed meanwhile, and for each how many others were computing as
    it began."""
    from pdserve.sim.load import drive, workload

    addr = dep.address
    drive(addr, workload(2, 32, 4, None, None, 32, seed), 2, None, seed, progress=False)
    dep.take_rounds()                               # the warm-up's rounds are not kept
    rounds, beside = [], []
    for i, (conc, prompt, out, n) in enumerate(loads):
        r = drive(addr, workload(n, prompt, out, None, None, prompt, seed + 1 + i), conc, None,
                  seed + 1 + i, progress=False)
        if r["failed"]:
            raise RuntimeError(f"calibrate --served: {r['failed']} of {n} requests of load "
                               f"{i + 1} failed ({'; '.join(r['errors'])}); fix the deployment "
                               "first (pdserve up and bench serve show why)")
        per_engine = dep.take_rounds()
        for rs in per_engine:
            rounds += rs
        beside += neighbours(per_engine)
        say(f"load {i + 1}/{len(loads)}: {n} requests of {prompt} + {out} tokens at "
            f"concurrency {conc}", len(rounds))
    return rounds, beside


def calibrate_served(cfg, source: str, seed: int = 0, loads=LOADS, progress: bool = True,
                     grid_args: dict | None = None, *, sweep: Sweep):
    """(profile, every round, the held-out report): the sweep's form
    (`sweep`, sim/calibrate/sweep.py's `calibrate`, on `grid_args`, the host to
    itself), scaled to the rounds the deployment `cfg` describes times
    while serving `loads`."""
    from pdserve.sim.host_load import ForeignLoad
    from pdserve.sim.cost.fit import (HOLD_OUT_EVERY, fit_factors, fit_serving,
                                             held_out_report)
    from pdserve.cluster.deploy import Deployment

    started = time.perf_counter()

    def say(what: str, n: int) -> None:
        if progress:
            print(f"pdserve calibrate: {what} ({n} served rounds, "
                  f"{time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    swept, swept_rounds, _ = sweep(cfg, grid_args, seed=seed, progress=progress,
                                   source=source)
    facts = swept.model
    dep = Deployment(cfg)
    dep.start()
    try:
        with ForeignLoad() as load:
            rounds, beside = served_rounds(dep, loads, seed, say)
    finally:
        dep.stop()
    if len(rounds) < MIN_ROUNDS:
        raise RuntimeError(f"calibrate --served: the engines timed only {len(rounds)} rounds "
                           f"(at least {MIN_ROUNDS} are needed); give the loads more requests")
    keep = [i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1 for i in range(len(rounds))]
    train = [(r, k) for (r, k), t in zip(zip(rounds, beside), keep) if t]
    held = [(r, k) for (r, k), t in zip(zip(rounds, beside), keep) if not t]
    scale, slowdown = fit_serving(swept.round, train, facts)
    cost = RoundCost(*(c * scale for c in swept.round.coefficients()))
    table = fit_factors(cost, train, facts, slowdown)
    held_rounds, held_beside = [r for r, _ in held], [k for _, k in held]
    report = held_out_report(cost, held_rounds, facts, slowdown, held_beside, table)
    untabled = held_out_report(cost, held_rounds, facts, slowdown, held_beside)
    measured = dict(swept.measured)
    measured.update({
        "served": {"loads": [list(x) for x in loads], "rounds": len(rounds),
                   "alone": sum(1 for k in beside if k == 0), "scale": round(scale, 4),
                   "held_out": len(held), "held_out_error": report,
                   "held_out_error_scale_only": untabled,
                   "foreign_cores": None if load.cores is None else round(load.cores, 2)},
        "seconds": round(time.perf_counter() - started, 1),
    })
    return dataclasses.replace(swept, round=cost, measured=measured, neighbour_slowdown=slowdown,
                               served_factors=table), swept_rounds + rounds, report
