"""Retraction (spec §2): freeing room when admission fails, without thrash.

`maybe_retract_for_capacity` runs last in the D and fused grammars. It fires
only when no prefill progressed this round and an admission failed for
capacity, and it serves one request: the first whose admission failed (the
capacity blocker). It retracts a victim, retries the blocker, and loops
until the blocker fits or no victim is left, so the freed pages reach the
request they were freed for in the same round.

Victims (`choose_victim`): incomplete prefills first, largest first; then
decode work by most newly releasable pages, then fewest tokens. Exempt: a
request whose admission secured decode room for its whole generation
(retracting it frees exactly what its readmission must take back). The
chosen victim must be quiescent (no forward of its own in flight); if it is
not, retraction waits rather than sacrificing a worse-ranked request.

`ensure_progress` is the liveness last resort: a round that built nothing,
with nothing in flight, while requests wait.

Where retraction cannot help, or grants a waiting request, it notes why in
`PlanBuild.waits` for `Planner.waiting_reasons()` (waiting.py).
"""

from __future__ import annotations

import pdserve.scheduler.fsm as fsm
from pdserve.scheduler.fsm import Prefilling
from pdserve.scheduler.round.build import PlanBuild
from pdserve.scheduler.round.decode import decode_phase, try_decode
from pdserve.scheduler.round.prefill import (
    first_in_line, new_prompt_phase, readmission_phase, resident_prefill_phase,
    try_new_prompt, try_resident_chunk)
from pdserve.scheduler.round.remote import try_remote_admission
from pdserve.scheduler.plan import RetractOp
from pdserve.scheduler.plan_state import PlannerState
from pdserve.scheduler.round.waiting import Hold


def _releasable(p: PlannerState, req) -> int:
    """Pages the victim alone holds: what retracting it returns to the pools."""
    n = 0
    for grp, table in zip(p.coord.groups, req.state.res.tables):
        rc = grp.pool.refcount
        n += sum(1 for pg in table if pg >= 0 and rc[pg] == 1)
    return n


def choose_victim(p: PlannerState, ignore_exemption: bool = False):
    """The best-ranked retractable resident, or None."""
    best, best_key = None, None
    for req in p.prefilling.values():
        st = req.state
        assert isinstance(st, Prefilling)       # `prefilling` holds Prefilling requests only
        res = st.res
        if res.covers_generation and not ignore_exemption:
            continue
        key: tuple[int, ...] = (len(res.tables[0]), req.seq)   # largest first, then youngest
        if best_key is None or key > best_key:
            best, best_key = req, key
    if best is not None:
        return best
    for req in p.running.values():
        st = req.state
        assert isinstance(st, fsm.Holding)      # running: PrefillDone, Decoding, RemotePrefillDone
        res = st.res
        if res.covers_generation and not ignore_exemption:
            continue
        key = (_releasable(p, req), -req.num_tokens, req.seq)
        if best_key is None or key > best_key:
            best, best_key = req, key
    return best


def retract(p: PlannerState, b: PlanBuild, victim, for_req=None) -> None:
    """Take the victim off the device. Its computed full pages are
    published; with a host tier its KV is snapshotted by a stream-ordered
    store and it waits as Retracted, otherwise it waits to re-prefill.
    Either way its pages are free for the rest of this plan build, and it
    yields to `for_req`, the request they were freed for (prefill.yields)."""
    victim.yields_to = (for_req, for_req.num_tokens) \
        if for_req is not None and for_req is not victim else None
    coord = p.coord
    st = victim.state
    computed = fsm.computed_tokens(victim)
    coord.publish(victim, st.res, computed // p.page_size, store=False)
    snapshot = coord.snapshot(victim.id, st.res, -(-computed // p.page_size), b.plan)
    stored = snapshot is not None
    if stored or not p.requeues_victims:
        # D has no ordinary prefill path back: it always recovers through
        # the ordered readmission, from an empty snapshot if need be
        res = fsm.retract_to_host(victim, p.next_epoch(), snapshot or [],
                                  computed if stored else 0)
    else:
        res = fsm.requeue(victim)
    coord.release(res)
    p.retracted_from_device(victim)
    b.plan.retracts.append(RetractOp(victim, stored))


def _retry(p: PlannerState, b: PlanBuild, req) -> bool:
    """Give the blocker its admission again; True if it was granted."""
    st = req.state
    if isinstance(st, (fsm.PrefillDone, fsm.Decoding, fsm.RemotePrefillDone)):
        if not try_decode(p, b, req):
            return False
        if b.can_decode():
            b.push_decode(req, req.state.res)
        return True                          # granted; decodes next round if it cannot join
    if isinstance(st, fsm.Waiting) and not p.decodes_use_budget:
        # D: a remote admission rides beside the batch, one a round
        return bool(b.plan.remote_prefills) or bool(try_remote_admission(p, b, req))
    if not b.can_prefill():
        if isinstance(st, fsm.Waiting):
            b.waits.line_closed(b, req)
        return True                          # cannot join this round: tried first next round
    if isinstance(st, Prefilling):
        return try_resident_chunk(p, b, req) is not False
    if isinstance(st, fsm.Waiting):
        return _grant_new_prompt(p, b, req) is not False
    return True


def _grant_new_prompt(p: PlannerState, b: PlanBuild, req) -> bool | None:
    """try_new_prompt for the request retraction freed room for. Whoever
    waits behind a grant that completes its prompt waits for the next round."""
    ok = try_new_prompt(p, b, req)
    if ok and not isinstance(req.state, Prefilling):
        b.waits.stop_line(Hold.RETRACTION_GRANT, req)
    return ok


def _grant_next_resident(p: PlannerState, b: PlanBuild, victim) -> bool:
    """The room a retracted blocker freed goes to the next admitted prefill
    its failure held behind it, if one can advance: it holds pages and
    progress already, which a newcomer would not. True if one did."""
    if not b.can_prefill():
        return False
    for req in list(p.prefilling.values()):
        if req is victim:
            continue
        if try_resident_chunk(p, b, req):
            b.waits.served = req.id
            return True
        return False                     # it heads the line: nobody passes it
    return False


def _beneficiary(p: PlannerState, victim):
    """Whom a retracted blocker's room goes to (the grants below, in their
    order): the next admitted prefill, else the first waiting prompt."""
    nxt = next((r for r in p.prefilling.values() if r is not victim), None)
    return nxt if nxt is not None else first_in_line(p, None, skip=victim)


def _grant_first_waiting(p: PlannerState, b: PlanBuild, victim) -> None:
    if b.new_prompts_sealed:
        return
    req = first_in_line(p, b, skip=victim)
    if req is None:
        return
    b.waits.served = req.id                   # the room is redirected to it
    if not p.decodes_use_budget:              # D: the grant is a remote admission
        if not b.plan.remote_prefills:
            try_remote_admission(p, b, req)
    elif b.can_prefill():
        _grant_new_prompt(p, b, req)
    else:
        b.waits.line_closed(b, req)


def maybe_retract_for_capacity(p: PlannerState, b: PlanBuild) -> None:
    if b.prefill_progressed or not b.admission_failed:
        if b.admission_failed:
            b.waits.retraction = "no retraction: a prefill progressed this round (§2)"
        return
    coord = p.coord
    if coord.loads or coord.pinned_stores_outstanding():
        # the acks return capacity by themselves (§2's global gates)
        b.waits.retraction = ("retraction deferred: a load-back is in flight" if coord.loads
                              else "retraction deferred: pinned stores hold pages until "
                              "their acks return them")
        return
    blocker = b.capacity_blocker
    assert blocker is not None          # b.fail() set it with admission_failed
    while True:
        victim = choose_victim(p)
        if victim is None:
            b.waits.retraction = ("no retraction victim: every resident's reserve covers "
                                  "its generation, or none is left")
            return
        if victim.state.res.forwards_out:
            b.waits.retraction = (f"retraction waits for its victim {victim.id}, whose "
                                  "forward is still in flight")
            return
        retract(p, b, victim, _beneficiary(p, victim) if victim is blocker else blocker)
        b.waits.served = blocker.id
        if victim is blocker:
            # granting its own pages straight back is the loop to break: a
            # prefill it held behind it, else the first waiting prompt gets
            # the room instead (unless a waiting readmission holds new
            # prompts back, §4)
            if not _grant_next_resident(p, b, victim):
                _grant_first_waiting(p, b, victim)
            return
        if _retry(p, b, blocker):
            return


def ensure_progress(p: PlannerState, b: PlanBuild) -> None:
    """A round that built nothing while requests wait, with no copy in
    flight, would repeat forever. Record the stall, retract one victim
    judging the exemption away, and run the phases again: decodes first,
    so the freed pages reach running generations before anything else."""
    plan = b.plan
    if not plan.is_empty() or not p.requests or p.coord.loads or p.coord.stores \
            or p.waiting_on_peer() or p.ending:    # ending: its forward lands (overlap.py)
        return
    if any(r.grammar_wait for r in p.waiting):  # a compile, not the pool, holds the line
        return
    for coll in (p.prefilling, p.running):
        for r in coll.values():
            st = r.state
            assert isinstance(st, fsm.Holding)  # residents hold pages
            if st.res.forwards_out:
                return                  # a landing result will change the state
    victim = choose_victim(p, ignore_exemption=True)
    p.record_stall(victim)
    if victim is None:
        return
    b.waits.last_resort = victim.id
    blocker = b.capacity_blocker
    retract(p, b, victim, blocker if blocker is not None and blocker is not victim
            else _beneficiary(p, victim))
    again = PlanBuild(plan, b.budget, b.batch_left, b.decodes_use_budget, b.prefill_may_join,
                      b.waits)
    decode_phase(p, again)
    readmission_phase(p, again)
    resident_prefill_phase(p, again)
    new_prompt_phase(p, again)
