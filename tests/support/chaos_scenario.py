"""One fault under load, judged by issue 53's rules, with the figures its
measurements ask for (tests/support/chaos_load.py has the load and the probes).

The rules, for every request sent before, during and after the fault:
none errs; each has exactly the tokens of the undisturbed run; none ends
more than LATENESS_BOUND_S after its undisturbed latency (less the time the
router itself was frozen, when the router is the victim: a client's only
path to any engine); requests sent after the fault obey the same; every
engine is alive again in the router's view; every engine ends idle, with no
page used, pinned or quarantined, and reports its quarantined pages at all.

The figures (printed; `pytest -s` shows them): for the requests in flight
when the fault began or sent during it, the time from the fault (or the
request's send, if later) to the request moving on (its next chunk), over
those that stalled; and the extra TTFT, over the undisturbed run, of the
requests sent during the fault that healthy engines served.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.client import Client

from support.chaos_load import (ALIVE_BOUND_S, IDLE_BOUND_S, LATENESS_BOUND_S, STALL_S, Checks, Fault,
                        OpenLoopLoad, Outcome, Reference, summary, wait_alive, wait_for,
                        wait_idle)

READY_BOUND_S = 60.0        # the victim holds work this soon after the load starts


@dataclass(frozen=True)
class Pace:
    interval_s: float           # a request sent every interval_s
    max_tokens: int
    fault_s: float              # how long the fault lasts
    after_s: float              # requests keep coming this long after it ends


@dataclass
class Run:
    fault: Fault
    outcomes: list[Outcome]
    began: float                # time.monotonic() at the fault's start ...
    ended: float                # ... and end


def run_fault(address: str, prompts: list[str], pace: Pace, fault: Fault, tag: str,
              engines: set[str]) -> Run:
    """The deployment idle; the load started; once `fault.ready`, the fault
    for pace.fault_s (ended whatever happens); the load on for pace.after_s;
    every request waited for."""
    with Client(address, timeout=30) as c:
        idle, rows, _ = wait_idle(c, engines, IDLE_BOUND_S)
    assert idle, f"{fault.name}: the deployment is not idle before the fault: {rows}"
    load = OpenLoopLoad(address, prompts, pace.interval_s, pace.max_tokens, tag,
                        request_timeout_s=pace.fault_s + pace.after_s + 120).start()
    began = ended = 0.0
    try:
        wait_for(lambda: fault.ready(load), READY_BOUND_S, f"{fault.name}: never ready")
        began = time.monotonic()
        fault.begin()
        try:
            time.sleep(pace.fault_s)            # the fault itself, not a wait for a state
        finally:
            fault.end()
            ended = time.monotonic()
        time.sleep(pace.after_s)                # requests sent after the thaw
    finally:
        outcomes = load.join(pace.fault_s + pace.after_s + 150)
    return Run(fault, outcomes, began, ended)


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def lateness(run: Run, o: Outcome, ref: Reference) -> float:
    """How much later than undisturbed the request ended, less the router's
    own freeze when the router was the victim."""
    excused = _overlap(o.sent, o.ended, run.began, run.ended) \
        if run.fault.stalls_every_stream else 0.0
    return o.latency - ref.latency[o.prompt] - excused


def _difference(run: Run, o: Outcome, want: list[int]) -> str:
    """Where a request's tokens leave the undisturbed run's, and when it
    was sent relative to the fault."""
    at = next((i for i, (a, b) in enumerate(zip(o.tokens, want)) if a != b),
              min(len(o.tokens), len(want)))
    return (f"request {o.index} (sent {o.sent - run.began:+.1f} s from the fault's start, "
            f"streamed by {o.engine}): {len(o.tokens)} tokens, the first differing at {at}")


def judge(run: Run, ref: Reference, address: str, engines: set[str]) -> Checks:
    """Every rule of the module docstring, as Checks (not yet finished)."""
    checks = Checks(run.fault.name)
    out = run.outcomes
    errors = [(o.index, o.error) for o in out if o.error]
    checks.check("no request errs", not errors,
                 f"{len(errors)} of {len(out)} erred, e.g. {errors[:3]}")
    wrong = [_difference(run, o, ref.tokens[o.prompt]) for o in out
             if not o.error and o.tokens != ref.tokens[o.prompt]]
    checks.check("every request has the tokens of the undisturbed run", not wrong,
                 f"{len(wrong)} of {len(out)} differ: {wrong[:10]}")
    late = sorted(((round(lateness(run, o, ref), 1), o.index) for o in out if not o.error),
                  reverse=True)
    over = [x for x in late if x[0] > LATENESS_BOUND_S]
    checks.check(f"no request ends more than {LATENESS_BOUND_S:.0f} s past its normal time",
                 not over, f"{len(over)} of {len(out)} late, worst (s, request) {over[:5]}")
    after = [o for o in out if o.sent >= run.ended]
    bad_after = [(o.index, "erred" if o.error else "wrong tokens"
                  if o.tokens != ref.tokens[o.prompt] else "late") for o in after
                 if o.error or o.tokens != ref.tokens[o.prompt]
                 or lateness(run, o, ref) > LATENESS_BOUND_S]
    checks.check("requests sent after the fault ended are right and on time",
                 bool(after) and not bad_after,
                 f"{len(bad_after)} of {len(after)} not: {bad_after[:12]}")
    with Client(address, timeout=30) as c:
        bound = max(1.0, run.ended + ALIVE_BOUND_S - time.monotonic())
        alive, view = wait_alive(c, engines, bound)
        checks.check(f"every engine serves again (router's view) within {ALIVE_BOUND_S:.0f} s "
                     "of the fault's end", alive, f"{view}")
        idle, rows, waited = wait_idle(c, engines, IDLE_BOUND_S)
    shown = [{k: r.get(k) for k in ("name", "running", "waiting", "used_pages",
                                    "pinned_pages", "quarantined", "error") if k in r}
             for r in rows]
    checks.check(f"every engine ends idle (nothing running or waiting, 0 used, 0 pinned, "
                 f"0 quarantined pages) within {IDLE_BOUND_S:.0f} s", idle,
                 f"after {waited:.1f} s: {shown}")
    missing = [r.get("name", "?") for r in rows if not r.get("quarantine_fields")]
    checks.check("every engine reports its quarantined pages", not missing,
                 f"no EngineStats field named '*quarantin*' for {missing} (issue 53 adds the "
                 "count to the Stats RPC): quarantined pages cannot be read, so 0 cannot be "
                 "asserted" if missing else f"{rows[0].get('quarantine_fields')}")
    return checks


def figures(run: Run, ref: Reference) -> dict:
    """The issue's measurements of one fault (see the module docstring)."""
    stalls, in_flight = [], 0
    for o in run.outcomes:
        if o.sent >= run.ended or (o.ended and o.ended <= run.began):
            continue                                # untouched by the fault
        in_flight += 1
        start = max(run.began, o.sent)
        stall = o.moved_on_after(start) - start
        if stall > max(STALL_S, 2 * ref.ttft[o.prompt]):
            stalls.append(stall)
    during = [o for o in run.outcomes if run.began <= o.sent < run.ended and not o.error]
    # the client sees only the engine that streamed: a request first sent to
    # the victim and moved counts as healthy here
    healthy = [o for o in during if o.engine.removeprefix("pdserve:") != run.fault.victim_engine]
    extra_ttft = [o.ttft - ref.ttft[o.prompt] for o in healthy]
    late = [lateness(run, o, ref) for o in run.outcomes if not o.error]
    return {"requests": len(run.outcomes), "touched": in_flight, "stalls": stalls,
            "extra_ttft_healthy": [] if run.fault.stalls_every_stream else extra_ttft,
            "lateness": late, "errors": sum(1 for o in run.outcomes if o.error)}


def report(run: Run, ref: Reference, pace: Pace) -> None:
    f = figures(run, ref)
    print(f"\n== {run.fault.name}: figures ({pace.fault_s:.0f} s fault, a request every "
          f"{pace.interval_s} s, {pace.max_tokens} tokens each) ==")
    print(f"  {ref.describe()}")
    print(f"  requests: {f['requests']}, in flight at the fault or sent during it: "
          f"{f['touched']}, stalled (a gap over {STALL_S:.0f} s): {len(f['stalls'])}, "
          f"erred: {f['errors']}")
    print(f"  fault -> every affected request moving on: {summary(f['stalls'])}")
    victim = run.fault.victim_engine or ""
    what = ("requests sent during the fault that a healthy D streamed (ones moved off the "
            "frozen D included)" if victim.startswith("decode") else
            "every request sent during the fault (a client cannot see which P prefilled it)"
            if victim else "every request sent during the fault")
    print(f"  extra TTFT, {what}: " +
          ("n/a: the router itself was frozen" if run.fault.stalls_every_stream
           else summary(f["extra_ttft_healthy"])))
    print(f"  lateness past the undisturbed run, every request: {summary(f['lateness'])}")


def run_and_judge(address: str, prompts: list[str], ref: Reference, pace: Pace, fault: Fault,
                  tag: str, engines: set[str]) -> None:
    """run_fault, then report the figures and finish the checks."""
    run = run_fault(address, prompts, pace, fault, tag, engines)
    report(run, ref, pace)
    judge(run, ref, address, engines).finish()
