"""A round that runs ahead (`engine.overlap`): the planner's rules when round
N+1 is built while round N's forward is still in flight.

    build(N+1)   while N runs: a decode in N may decode again (runs_ahead)
    wait(N)
    apply(N)     late rules (apply): a stop in N ends the request after N+1
    launch(N+1)

Only decodes run ahead of their own forward: a Decoding request whose one
forward in flight is a plain decode (not a speculative verify, whose
accepted count is unknown until it lands) decodes again, its page need counting the
token N adds (num_tokens + 1); its input is N's sampled token, which the
executor takes on the device. A prefill chunk's next chunk needs no sampled
token and goes as it would (the phases never look at forwards_out there).
Nothing else with a forward out is scheduled: a completing chunk's first
decode waits for its token, retraction never picks a request with a forward
out (retraction.py), and the last resort never runs while one is out.

Ends apply one round late. A request whose end is decided while a forward of
its own is still out (a stop sampled in N while it is in N+1, or an abort)
leaves the schedule for `Planner.ending`: no phase sees it, the tokens of its
remaining forwards are dropped, and once the last one lands it is finished
or aborted, exactly once, and only then are its pages released. A request
whose generation budget ends with N's token is never scheduled ahead, so
only stops (EOS, stop ids, stop strings) and aborts take this path.

With overlap off no forward is ever out at build(), and none of this runs.
"""

from __future__ import annotations

import dataclasses

import pdserve.scheduler.fsm as fsm
from pdserve.scheduler.cache.demands import demands
from pdserve.scheduler.fsm import Decoding
from pdserve.scheduler.plan import Plan, StepResult
from pdserve.scheduler.plan_state import Ending, PlannerState


def runs_ahead(p: PlannerState, plan: Plan, req) -> bool:
    """Decode phase, a request with a forward out: may it decode again in
    the round being built? Only a decode in flight (Decoding, one forward
    out) that N's token does not end by length, with the page for position
    num_tokens (N's token) admitted here. A refused page is no capacity
    failure: it decodes normally once its forward lands."""
    st = req.state
    if not p.cfg.overlap or st.__class__ is not Decoding or st.res.forwards_out != 1 \
            or req.remaining_new_tokens <= 1 or req.drafts or p.speculating:
        # a verify in flight adds tokens no one knows yet, and a decode that
        # may propose candidates waits for them (speculation.py)
        return False
    n = req.num_tokens + 1              # N's token included
    if n <= req.capacity:
        return True
    ps = p.page_size
    # publish only what N's forward does not write: positions below num_tokens - 1
    return p.coord.admit(req, st.res, demands(p, n - 1, n, 0, 0, decode=True),
                         (req.num_tokens - 1) // ps, plan)


def end_after_forward(p: PlannerState, req_id: str, reason: str):
    """Abort `req_id` now if no forward of its own is out (returns it), else
    once the last one lands (returns None; `apply` reports it then). A
    request already ending by a stop finishes as it was going to."""
    req = p.requests.get(req_id)
    if req is None:
        raise KeyError(f"no live request {req_id!r}")
    st = req.state
    if not (isinstance(st, fsm.Holding) and st.res.forwards_out):
        return p.abort(req_id, reason)
    if req_id not in p.ending:
        _hold(p, req, reason, aborted=True)
    return None


def _hold(p: PlannerState, req, reason: str, aborted: bool) -> None:
    """Off the schedule until its forwards land (invariants.py knows)."""
    p.prefilling.pop(req.id, None)
    p.running.pop(req.id, None)
    p.ending[req.id] = Ending(req, reason, aborted)


def apply(p: PlannerState, plan: Plan, result: StepResult):
    """`Planner.apply` with ends one round late; returns (finished, aborted):
    the requests released this round."""
    ending = p.ending
    late = [op.req for op in plan.prefills if op.req.id in ending] + \
        [r for r in plan.decodes if r.id in ending]
    if late:
        plan, result = _without(plan, result, ending)
        for req in late:
            req.state.res.forwards_out -= 1     # its token is dropped: it ended a round ago
    # a stop sampled for a request already in the next round's forward
    stops = [r for r in result.stopped
             if r.state.holds_pages and r.state.res.forwards_out > 1]
    if stops:
        result = dataclasses.replace(result, stopped=result.stopped - set(stops))
    finished = p.apply(plan, result)
    for req in stops:
        _hold(p, req, "stop", aborted=False)
    aborted = []
    for req in dict.fromkeys(late):
        if req.state.res.forwards_out:
            continue
        e = ending[req.id]
        if e.aborted:
            p.abort(req.id, e.reason)
            aborted.append(req)
        else:
            p._finish(req, e.reason)         # publishes, then releases (and leaves `ending`)
            finished.append(req)
    return finished, aborted


def _without(plan, result, ending):
    """The plan and result with the ops of ending requests taken out."""
    keep_p = [i for i, op in enumerate(plan.prefills) if op.req.id not in ending]
    keep_d = [i for i, r in enumerate(plan.decodes) if r.id not in ending]
    gone = {id(op.req) for op in plan.prefills if op.req.id in ending} | \
        {id(r) for r in plan.decodes if r.id in ending}
    plan = dataclasses.replace(plan, prefills=[plan.prefills[i] for i in keep_p],
                               decodes=[plan.decodes[i] for i in keep_d])
    result = dataclasses.replace(
        result, prefill_tokens=[result.prefill_tokens[i] for i in keep_p],
        decode_tokens=[result.decode_tokens[i] for i in keep_d],
        stopped={r for r in result.stopped if id(r) not in gone},
        decode_more={k: v for k, v in result.decode_more.items() if k not in ending},
        drafts={k: v for k, v in result.drafts.items() if k not in ending})
    return plan, result


def fail_plans(p: PlannerState, plans, reason: str) -> list:
    """The executor lost the round in flight: it and every later plan built
    on it fail together (`Planner.fail_plan` for each, their forwards given
    back first so none is aborted with a forward still counted)."""
    first, later = plans[0], [q for q in plans[1:] if q is not None]
    touched = []
    for plan in later:
        for req in [op.req for op in plan.prefills] + list(plan.decodes):
            if req.state.holds_pages:
                req.state.res.forwards_out -= 1
            touched.append(req)
        for s in plan.stores:
            p.coord.store_failed(s.id)
        for ld in plan.loads:
            p.coord.load_done(ld.id)
        touched += list(plan.readmits) + [r.req for r in plan.retracts if r.stored]
    failed = p.fail_plan(first, reason)
    for req in touched:
        if req.id in p.requests and req not in failed:
            p.abort(req.id, reason)
            failed.append(req)
    return failed


def check_ending(p: PlannerState, req, where) -> None:
    """An ending request sits in no other collection and still has a
    forward out (with none out it would have been released)."""
    st = req.state
    if any(where) or not isinstance(st, fsm.RESIDENT) or not st.res.forwards_out:
        raise AssertionError(f"{req.id}: ending, but in {where} as "
                             f"{type(st).__name__} with {getattr(getattr(st, 'res', None), 'forwards_out', 0)} forwards out")
