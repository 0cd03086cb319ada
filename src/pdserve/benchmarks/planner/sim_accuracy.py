"""`pdserve bench sim-accuracy`: the simulator against the real deployment.

For each --config: start the deployment (as `bench serve` does; with
`--in-process`, its one fused engine in this process, sim/local_engine.py,
where Ray cannot run), find its saturation (closed loop at
`--sat-concurrency`, req/s), then load it at concurrency 1 (closed loop)
and at each of `--fractions` x saturation, `--repeats` times: Poisson
arrivals of synthetic prompts, or with `--trace` a trace's first requests
(their shared prefixes kept, sim/load.py) at its own arrival times scaled
to that rate. The simulator runs the same
requests (the same prompt tokens, output lengths and arrival times; at
concurrency 1 each request alone) on the config with `simulate.profile` set
to `--profile`. Each run draws fresh prompts (its own seed), so no run is
served from the prefix cache an earlier one filled. Reports TTFT and TPOT
p50 and p90 of both, medians over the runs with their spread, and the
error (median sim / median real - 1).

Each run is also simulated at its engines' own speed: the profile's rounds
of each kind (prefill, decode, mixed) divided by (1 + the run's busy-time
error on that kind), i.e. scaled so that the profile prices the rounds the
engines ran in that run at what they took (`--one-speed`: one factor for
every kind, the whole busy-time error, as before 2026-12-02).
On a host whose speed drifts between runs (this 2-core VM moved 30% within
an hour), that separates the two sources of error: the host's speed at the
time (which a profile measured earlier cannot know) and the simulator's
scheduling and queueing (the rest). That view uses the run's own rounds;
a third one predicts: before each real run `--probe` requests run alone
(as at concurrency 1, fresh prompts), and the run is simulated with the
profile scaled to the speed those rounds showed (per kind likewise; a kind
the probe did not run, e.g. mixed, at the probe's whole busy-time error),
as a recalibration a minute before the run would. A fourth also predicts:
from its second run on, each level is simulated at the speed its previous
run showed (per kind): the profile corrected by the last window measured at
that load, as NVIDIA Dynamo's planner corrects its profile by what it
observes.

Every run also records the CPU that processes outside this benchmark's
process tree used meanwhile (`foreign_cores`): on a shared machine another
workload's load shows up as a slower real run, not as a simulator error.
With `--quiet C` each real run first waits (up to 15 minutes) until they
use under C cores. `--replay FILE` simulates the real runs a previous
`--out FILE` recorded again, with another `--profile`, starting nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from typing import Any

from pdserve.benchmarks.common.traces import MOONCAKE_CONV, trace_file
from pdserve.benchmarks.common.options import non_negative, positive, usage_error, workload_arguments
from pdserve.benchmarks.planner.sim_accuracy_report import cores, ms, pct, print_report
from pdserve.sim.load import Sample, arrivals, drive, workload
from pdserve.sim.local_engine import LocalEngineError
from pdserve.sim.host_load import ForeignLoad, wait_for_quiet
from pdserve.sim.cost.fit import errors
from pdserve.sim.cost.profile import KINDS, Profile, load_profile, neighbours, save_profile

ALONE_GAP_S = 1e4     # concurrency 1 in the simulator: arrivals this far apart
PROBE_SEED = 50       # a probe's prompts: seeds no run of the level uses


def sim_trace(samples: list[Sample], due: list[float] | None, max_tokens: int):
    from pdserve.sim.trace import TraceRequest
    from pdserve.scheduler.request import TokenPrompt

    times = due if due is not None else [i * ALONE_GAP_S for i in range(len(samples))]
    return [TraceRequest(f"r{i}", t, TokenPrompt(list(s.prompt)), s.max_tokens, s.max_tokens)
            for i, (s, t) in enumerate(zip(samples, times))]


def simulate(cfg, profile: str, samples, due, max_tokens: int) -> dict:
    from pdserve.sim.simulation import Simulation
    from pdserve.sim.report import percentile

    sim_cfg = dataclasses.replace(cfg, simulate=dataclasses.replace(cfg.simulate,
                                                                    profile=profile))
    sim = Simulation(sim_cfg, sim_trace(samples, due, max_tokens), progress=False)
    res = sim.run()
    fin = [r for r in res["requests"] if r["status"] == "finished"]

    def p50_p90(key):
        xs = [r[key] for r in fin if r[key] is not None]
        return {"p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9)}
    return {"ok": len(fin), "ttft_s": p50_p90("ttft_s"), "tpot_s": p50_p90("tpot_s"),
            "rounds": sim.rounds}


def measure(path: str, profile: str, w: dict, fractions, repeats: int,
            saturation: float | None, sat_concurrency: int, seed: int,
            quiet: float | None = None, probe: int = 0, one_speed: bool = False,
            in_process: bool = False) -> dict:
    """Every run draws fresh prompts (its own seed): a prompt the deployment
    has seen would be served from its prefix cache, and the simulator, which
    starts empty each run, would compute it whole. `w`: the workload
    (requests, alone, prompt_len, max_tokens, trace). `in_process`: the
    config's one fused engine in this process (sim/local_engine.py), not
    the deployment under Ray."""
    from pdserve.config import load_config

    cfg = load_config(path)
    out = {"config": path, "runs": [], "workload": w, "in_process": in_process}
    prof = load_profile(profile)
    if quiet is not None:
        wait_for_quiet(quiet)       # Ray's start times out on an overloaded machine
    real = _start(cfg, in_process)
    try:
        runs = RealRuns(real, prof, w, quiet, probe)
        real.load(level_samples(w, None, seed + 1), 4, None, seed)  # warm-up
        if saturation is None:
            sat = runs.saturation(sat_concurrency, seed)
            saturation = sat["req_per_s"]
            out["saturation_run"] = sat
        out["saturation_req_per_s"] = saturation  # type: ignore[assignment]
        levels = [("c1", None)] + [(f"{f:g}x", f * saturation) for f in fractions]
        out["levels"] = [{"level": name, "rate": rate} for name, rate in levels]  # type: ignore[misc]
        for rep in range(repeats):
            for i, (name, rate) in enumerate(levels):
                r = runs.one(name, rate, rep, seed + 100 * (rep + 1) + i)
                out["runs"].append(r)  # type: ignore[attr-defined]
                _print_run(path, r)
    finally:
        real.close()
    resimulate(out, profile, one_speed)
    return out


def _start(cfg, in_process: bool):
    """The real side: a LocalEngine, or the deployment started under Ray."""
    if in_process:
        from pdserve.sim.local_engine import LocalEngine

        return LocalEngine(cfg)
    from pdserve.cluster.deploy import Deployment

    dep = Deployment(cfg)
    return Served(dep, dep.start())


@dataclass
class Served:
    """A deployment under Ray, loaded through its router: the real side
    as sim/local_engine.py's LocalEngine is in process."""
    dep: Any                    # the Deployment
    address: str

    def load(self, samples: list[Sample], concurrency: int, rate, seed: int) -> dict:
        return drive(self.address, samples, concurrency, rate, seed, progress=False)

    def take_rounds(self) -> list[list]:
        return self.dep.take_rounds()

    def close(self) -> None:
        self.dep.stop()


def level_samples(w: dict, rate: float | None, seed: int) -> list[Sample]:
    """A run's requests, each with its arrival: at `rate` (req/s), Poisson,
    or with a trace its own arrivals scaled to that mean rate; None, a
    closed loop of the `alone` requests (arrival None). Synthetic prompts
    of `prompt_len` tokens, or the trace's first requests, their prompts
    cut at `prompt_len`. What the real run and its simulation share."""
    n = w["alone"] if rate is None else w["requests"]
    samples = workload(n, w["prompt_len"], w["max_tokens"], w.get("trace"), n,
                       w["prompt_len"], seed)
    if rate is None:
        return _closed(samples)
    times: list[float] = [s.arrival_s for s in samples] if w.get("trace") else []  # type: ignore[misc]
    span = max(times) - min(times) if times else 0.0
    if span > 0:            # the trace's own shape, at a mean rate of `rate`
        due = [(t - min(times)) * (len(samples) - 1) / rate / span for t in times]
    else:                   # synthetic, or a trace that sends everything at once: Poisson
        due = arrivals(samples, rate, seed)  # type: ignore[assignment]
    return [dataclasses.replace(s, arrival_s=t) for s, t in zip(samples, due)]


def _closed(samples: list[Sample]) -> list[Sample]:
    """`samples` without arrivals: a closed loop."""
    return [dataclasses.replace(s, arrival_s=None) for s in samples]


@dataclass
class RealRuns:
    """The real runs on one started real side (a Served deployment or a
    LocalEngine): each a fresh batch of prompts (its own seed), the
    engines' rounds timed and priced by the profile, and what other
    processes used meanwhile."""
    real: Any
    prof: Profile
    w: dict                     # the workload (measure's)
    quiet: float | None         # wait before each run until others use under this many cores
    probe: int                  # requests run alone before each run, to time the host's speed

    def engine_rounds(self) -> dict:
        """The profile against the rounds the engines timed since the last call."""
        return round_errors(self.prof, self.real.take_rounds())

    def saturation(self, concurrency: int, seed: int) -> dict:
        """A closed loop at `concurrency`: its req/s is the saturation."""
        if self.quiet is not None:
            wait_for_quiet(self.quiet)
        batch = _closed(level_samples(self.w, 1.0, seed + 2))
        with ForeignLoad() as load:
            r = self.real.load(batch, concurrency, None, seed)
        return {**r, "foreign_cores": load.cores}

    def one(self, level: str, rate: float | None, rep: int, run_seed: int) -> dict:
        """One run of `level` (rate None: concurrency 1), with its probe
        before it, and the rounds each timed."""
        if self.quiet is not None:
            wait_for_quiet(self.quiet)
        self.engine_rounds()                    # what ran before this run
        probed = None
        if self.probe:                          # the host's speed just before the run
            alone = dict(self.w, alone=self.probe)
            self.real.load(level_samples(alone, None, run_seed + PROBE_SEED), 1, None, run_seed)
            probed = self.engine_rounds()
        samples = level_samples(self.w, rate, run_seed)
        with ForeignLoad() as load:
            r = self.real.load(samples, 1 if rate is None else len(samples), None, run_seed)
        r.update(level=level, repeat=rep, seed=run_seed, rate=rate,
                 foreign_cores=load.cores, rounds=self.engine_rounds())
        if probed is not None:
            r["probe"] = probed
        return r


def _print_run(path: str, r: dict) -> None:
    rd = r["rounds"]
    print(f"  {path} {r['level']} run {r['repeat'] + 1}: TTFT p50 {ms(r['ttft_s']['p50'])} "
          f"TPOT p50 {ms(r['tpot_s']['p50'])}, {r['req_per_s']:.2f} req/s, "
          f"foreign load {cores(r['foreign_cores'])}; {rd['count']} engine rounds, "
          f"profile vs each {pct(rd['err_p50'])} p50, vs busy time "
          f"{pct(rd['busy_err'])} ("
          + ", ".join(f"{k} {pct(v)}" for k, v in rd["by_kind"].items()) + ")",
          flush=True)


def round_errors(prof: Profile, per_engine: list[list]) -> dict:
    """The profile against real rounds (per engine, in order): the
    simulator's cost of each round, apart from its scheduling. `busy_err`:
    what it predicts for all of them over what they took, less 1; `by_kind`,
    the same for prefill, decode and mixed rounds apart (a host's speed need
    not move them alike: on the 2026-12-02 check decode rounds ran 19%
    faster than priced while prefill rounds ran as priced)."""
    rounds = [r for rs in per_engine for r in rs]
    if not rounds:
        return {"count": 0, "err_p50": None, "busy_err": None, "by_kind": {}}
    errs = errors(prof.round, rounds, prof.model, prof.neighbour_slowdown,
                  neighbours(per_engine), prof.served_factors, prof.speed)

    def busy_err(pairs) -> float:
        busy = sum(r.seconds for _, r in pairs)
        return sum((1 + e) * r.seconds for e, r in pairs) / busy - 1
    kinds: dict[str, list] = {}
    for e, r in zip(errs, rounds):
        kinds.setdefault(r.kind, []).append((e, r))
    return {"count": len(rounds), "busy_s": sum(r.seconds for r in rounds),
            "err_p50": statistics.median(errs), "busy_err": busy_err(list(zip(errs, rounds))),
            "by_kind": {k: busy_err(v) for k, v in sorted(kinds.items())}}


def resimulate(res: dict, profile: str, one_speed: bool = False) -> None:
    """Simulate each recorded real run: the same requests at the same times,
    with `profile` ("sim"); where the run timed its engines' rounds, with
    the profile at their speed ("sim_own_speed"); where a probe ran before
    it, at the speed the probe's rounds showed ("sim_probed"); after the
    first run of a level, at the speed the level's previous run showed
    ("sim_previous"). Speeds are per round kind where the runs recorded
    them, unless `one_speed`."""
    from pdserve.config import load_config

    cfg, w = load_config(res["config"]), res["workload"]
    prof = load_profile(profile)
    previous: dict = {}                 # level -> the rounds its last run so far timed
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(res["runs"]):
            samples = level_samples(w, r["rate"], r["seed"])
            due = arrivals(samples, None, 0)       # theirs; None: a closed loop
            r["sim"] = simulate(cfg, profile, samples, due, w["max_tokens"])
            speeds = {"sim_own_speed": r.get("rounds"), "sim_probed": r.get("probe"),
                      "sim_previous": previous.get(r["level"])}
            for view, rounds in speeds.items():
                r.pop(view, None)
                if _timed(rounds):
                    scaled = os.path.join(tmp, f"run{i}-{view}.yaml")
                    by_kind = {} if one_speed else rounds.get("by_kind", {})
                    save_profile(at_speed(prof, rounds["busy_err"], by_kind), scaled)
                    r[view] = simulate(cfg, scaled, samples, due, w["max_tokens"])
            if _timed(r.get("rounds")):
                previous[r["level"]] = r["rounds"]
    res["profile"] = profile
    res["one_speed"] = one_speed


def _timed(rounds: dict | None) -> bool:
    """Whether a run's (or probe's) `round_errors` priced any round."""
    return (rounds or {}).get("busy_err") is not None


def at_speed(prof: Profile, busy_err: float, by_kind: dict | None = None) -> Profile:
    """`prof` on an engine that ran faster or slower than it prices: each
    round kind's cost divided by (1 + its error in `by_kind`), what the
    profile predicted for a run's rounds of that kind over what they took,
    less 1; a kind not there by (1 + `busy_err`), the error on all of them."""
    by_kind = by_kind or {}
    speed = {k: prof.speed.get(k, 1.0) / (1 + by_kind.get(k, busy_err)) for k in KINDS}
    return dataclasses.replace(prof, speed=speed)


def main(configs: list[str], profile: str, w: dict, fractions, repeats: int,
         saturation: float | None, out: str | None, sat_concurrency: int = 16, seed: int = 0,
         quiet: float | None = None, replay: str | None = None, probe: int = 0,
         one_speed: bool = False, in_process: bool = False) -> int:
    """`w`: the workload (requests, alone, prompt_len, max_tokens, trace).
    `replay`: a JSON this wrote; its real runs are simulated again with
    `profile`, nothing is started (to compare profiles on one set of runs).
    `probe`: requests run alone before each real run, to probe its speed.
    `one_speed`: the views at a measured speed scale every round kind alike.
    `in_process`: each config's one fused engine in this process, no Ray."""

    load_profile(profile)              # a bad profile fails before any deployment starts
    profile = os.path.abspath(profile)
    if replay:
        with open(replay) as f:
            results = json.load(f)
        for res in results:
            resimulate(res, profile, one_speed)
    else:
        results = []
        for path in configs:
            results.append(measure(path, profile, w, fractions, repeats, saturation,
                                   sat_concurrency, seed, quiet, probe, one_speed, in_process))
            print(f"{path}: saturation {results[-1]['saturation_req_per_s']:.2f} req/s",
                  flush=True)
    print_report(results, profile, replay, one_speed)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append",
                   help="config YAML: start this deployment (repeat to compare)")
    p.add_argument("--profile", help="the cost profile the simulator uses (pdserve calibrate)")
    workload_arguments(p)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.9, 1.1],
                   help="the loaded levels' rates as fractions of the measured saturation "
                        "(0.5 0.9 1.1): Poisson, or a --trace's own arrivals scaled to it")
    p.add_argument("--saturation", type=float,
                   help="saturation in req/s (default: measured closed-loop at concurrency 16)")
    p.add_argument("--alone", type=positive, default=8,
                   help="requests run at concurrency 1 (8)")
    p.add_argument("--repeats", type=positive, default=1, help="real runs of each level (1)")
    p.add_argument("--quiet", type=float,
                   help="before each real run, wait until processes outside the benchmark use "
                        "under this many cores")
    p.add_argument("--out", help="save the results as JSON here")
    p.add_argument("--probe", type=non_negative, default=2,
                   help="requests run alone before each real run, whose rounds say the "
                        "host's speed just then (2; 0: no probe)")
    p.add_argument("--replay", help="simulate the real runs of this --out JSON again with "
                                    "--profile; start nothing")
    p.add_argument("--trace", help="replay this trace's first --requests requests (ours or "
                                   "Mooncake's JSONL: their prompts cut at --prompt-len, shared "
                                   "prefixes kept; outputs cut at --max-tokens), their arrival "
                                   "times scaled to each level's rate; default: synthetic prompts "
                                   "arriving Poisson")
    p.add_argument("--in-process", action="store_true",
                   help="run each config's one fused engine in this process (no Ray, router "
                        "or gRPC: a GPU host without Ray) instead of starting the deployment")
    p.add_argument("--one-speed", action="store_true",
                   help="scale the own-speed, probed and previous-run views by one factor "
                        "for every round kind, not one per kind")


def run(args) -> int:
    if not (args.config or args.replay) or not args.profile:
        return usage_error("bench sim-accuracy needs --config (repeatable) or --replay, "
                           "and --profile (from pdserve calibrate)")
    if args.trace:
        trace_file(args.trace, MOONCAKE_CONV)       # a missing trace fails before any start
    w = {"requests": args.requests, "alone": min(args.alone, args.requests),
         "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "trace": args.trace}
    try:
        return main(args.config or [], args.profile, w, args.fractions, args.repeats,
                    args.saturation, args.out, quiet=args.quiet, replay=args.replay,
                    probe=args.probe, one_speed=args.one_speed, in_process=args.in_process)
    except LocalEngineError as e:
        return usage_error(f"bench sim-accuracy --in-process: {e}")
