"""Planner.waiting_reasons(): why each request that is not running waits,
one rule a test (spec §1.1, §2, §3.2, §4), then random workloads in which
every waiting, retracted and landing request gets exactly one reason."""

import pytest
from hypothesis import given, settings

from pdserve.scheduler import Planner
from pdserve.scheduler.fsm import Retracted, Waiting
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.round.waiting import Hold, WaitReason

from support.pd import PDPair
from support.planner import config, req, result_for, run_to_completion, step
from test_scheduler_property import pd_workloads, tight_workloads, workloads


def reasons(p) -> dict[str, WaitReason]:
    out = p.waiting_reasons()
    assert len({r.req_id for r in out}) == len(out), "a request has two reasons"
    return {r.req_id: r for r in out}


def build_until_retracted(p, max_rounds=200):
    """Run rounds until one retracts someone; return that plan, built and
    not yet applied, so the reasons are still the ones it left."""
    for _ in range(max_rounds):
        plan = p.build()
        if plan.retracts:
            return plan
        p.apply(plan, result_for(plan))
        p.check_invariants()
    raise AssertionError("nothing was ever retracted")


def d_planner(**kw):
    return Planner(config(**kw), Role.DECODE)


def p_planner(**kw):
    return Planner(config(**kw), Role.PREFILL)


# ---- the waiting line (§1.1) ---------------------------------------------------

def test_prompts_behind_an_incomplete_prefill_wait_behind_incomplete_prefill():
    """§1.1: an incomplete prefill holds the line; new prompts may not pass it,
    in the round it is admitted and in the rounds its later chunks run."""
    p = Planner(config(max_scheduled_tokens=32))
    p.submit(req("long", 100))
    p.submit(req("short", 4))
    p.submit(req("tiny", 1))
    for _ in range(2):
        plan = p.build()
        assert [op.req.id for op in plan.prefills] == ["long"]
        rs = reasons(p)
        for rid in ("short", "tiny"):
            assert rs[rid].reason == "behind_incomplete_prefill"
            assert rs[rid].blocked_by == "long"
            assert rs[rid].pages_needed is None
        p.apply(plan, result_for(plan))


def test_a_prompt_the_leftover_token_budget_cannot_start_waits_for_budget():
    """Budget: seven decodes leave 3 tokens, too few for the long prompt to
    reach a page boundary; the tiny prompt behind it waits by the same rule."""
    p = Planner(config(max_scheduled_tokens=10, page_size=4))
    for i in range(7):
        p.submit(req(f"d{i}", 1, max_new=50))
    step(p)
    p.submit(req("long", 100))
    p.submit(req("tiny", 1))
    p.build()
    rs = reasons(p)
    assert rs["long"].reason == "budget" and rs["long"].blocked_by is None
    assert "3 tokens" in rs["long"].detail
    assert rs["tiny"].reason == "budget" and rs["tiny"].blocked_by == "long"


def test_a_prompt_after_decodes_spent_the_token_budget_waits_for_budget():
    """Budget (§3.3): in mixed mode decodes take the token budget first; when
    they spend all of it, the first waiting prompt is stopped by the budget."""
    p = Planner(config(max_scheduled_tokens=8, page_size=4))
    for i in range(8):
        p.submit(req(f"d{i}", 1, max_new=50))
    step(p)
    p.submit(req("new", 4))
    plan = p.build()
    assert len(plan.decodes) == 8 and plan.prefills == []
    r = reasons(p)["new"]
    assert r.reason == "budget" and r.blocked_by is None
    assert "token budget is spent" in r.detail


def test_prompts_past_the_rounds_batch_slots_wait_for_budget():
    """Budget: a round holds max_batch_size requests; the first prompt left
    out is stopped by the slots, the rest wait behind it."""
    p = Planner(config(max_batch_size=3))
    for i in range(5):
        p.submit(req(f"r{i}", 4))
    p.build()
    rs = reasons(p)
    assert set(rs) == {"r3", "r4"}
    assert rs["r3"].reason == "budget" and rs["r3"].blocked_by is None
    assert "batch slots" in rs["r3"].detail
    assert rs["r4"].reason == "budget" and rs["r4"].blocked_by == "r3"


def test_a_prompt_whose_admission_fails_waits_for_capacity_with_its_pages():
    """Capacity: big1 needs 11 pages (40 prompt + 4 headroom tokens) and 9
    are free beside big0; small would fit, but waits behind big1."""
    p = Planner(config(page_size=4, total_pages=20, max_scheduled_tokens=64))
    p.submit(req("big0", 40, max_new=4))
    p.submit(req("big1", 40, max_new=4))
    p.submit(req("small", 4, max_new=4))
    p.build()
    rs = reasons(p)
    big1 = rs["big1"]
    assert big1.reason == "capacity" and big1.blocked_by is None
    assert (big1.pages_needed, big1.pages_free) == (11, 9) == (11, p.free_pages())
    assert "11 pages, 9 free" in big1.detail
    assert rs["small"].reason == "capacity" and rs["small"].blocked_by == "big1"
    assert rs["small"].pages_needed is None


def test_capacity_counts_evictable_cached_pages_as_free():
    """Capacity: idle cached pages are free to admission, so they count in
    pages_free; the idle pages of the request's own prefix hit count on both
    sides (it claims them), matching Planner.free_pages()."""
    p = Planner(config(page_size=4, total_pages=16, max_scheduled_tokens=64))
    shared = list(range(1, 17))
    p.submit(req("a", shared, max_new=2))
    run_to_completion(p)                          # its 4 prompt pages stay cached, idle
    assert p.free_pages() == 16
    p.submit(req("hog", 20, max_new=4))           # 6 pages off the free list
    p.submit(req("x", shared + list(range(30, 50)), max_new=8))   # 44 tokens: 11 pages
    p.build()
    x = reasons(p)["x"]
    assert x.reason == "capacity"
    # 6 free + 4 idle cached; x claims the 4 cached ones as its hit and needs 7 more
    assert (x.pages_needed, x.pages_free) == (11, 10) == (11, p.free_pages())


def test_a_blocked_admission_notes_that_retraction_waits_for_a_victim_in_flight():
    """Retraction quiescence (§2): the only victim is in this round's decode
    batch, so retraction waits for its forward; the blocked prompt's detail
    says so."""
    p = Planner(config(page_size=4, total_pages=12, safe_steps=4))
    p.submit(req("a", 4, max_new=40))
    step(p)
    p.submit(req("x", 40, max_new=4))             # 11 pages; 10 free
    plan = p.build()
    assert [r.id for r in plan.decodes] == ["a"] and plan.retracts == []
    x = reasons(p)["x"]
    assert x.reason == "capacity" and (x.pages_needed, x.pages_free) == (11, 10)
    assert "retraction waits for its victim a" in x.detail


def test_a_waiting_readmission_seals_new_prompts_behind_it():
    """§4: a readmission that does not fit waits, and new prompts are sealed
    behind it (a newcomer taking its pages would starve it)."""
    p = Planner(config(page_size=4, total_pages=12, safe_steps=4, host_pages=64))
    for rid in "abc":
        p.submit(req(rid, 6, max_new=30))
    plan = build_until_retracted(p)
    victim = plan.retracts[0].req
    p.apply(plan, result_for(plan))
    p.submit(req("new", 2, max_new=1))
    sealed = 0
    while isinstance(victim.state, Retracted):
        plan = p.build()
        if isinstance(victim.state, Retracted):
            rs = reasons(p)
            assert rs["new"].reason == "readmission_seal", rs["new"]
            assert rs["new"].blocked_by == victim.id
            sealed += 1
        p.apply(plan, result_for(plan))
    assert sealed
    run_to_completion(p)
    p.assert_idle()


def test_a_readmission_that_does_not_fit_waits_for_capacity_and_retracts_no_one():
    """§4: the readmission's own reason is capacity, with its pages, and the
    detail says a readmission never triggers retraction."""
    p = Planner(config(page_size=4, total_pages=12, safe_steps=4, host_pages=64))
    for rid in "abc":
        p.submit(req(rid, 6, max_new=30))
    plan = build_until_retracted(p)
    victim = plan.retracts[0].req
    p.apply(plan, result_for(plan))
    plan = p.build()
    assert isinstance(victim.state, Retracted) and plan.retracts == []
    r = reasons(p)[victim.id]
    assert r.reason == "capacity" and r.blocked_by is None
    assert r.pages_needed > r.pages_free
    assert "never triggers retraction" in r.detail


def test_one_readmission_a_round_the_others_wait_for_the_readmission_limit():
    """§4: at most one readmission a round; the other retracted requests wait
    behind it (here on D, whose failed transfers recover by readmission)."""
    d = d_planner(page_size=4, max_scheduled_tokens=64)
    for rid in ("x", "y", "z"):
        d.submit(req(rid, 8))
        step(d)
    for rid in ("x", "y", "z"):
        d.transfer_failed(rid, "peer lost")
    plan = d.build()
    assert [r.id for r in plan.readmits] == ["x"]
    rs = reasons(d)
    for rid in ("y", "z"):
        assert rs[rid].reason == "readmission_limit" and rs[rid].blocked_by == "x"


# ---- retraction (§2) ------------------------------------------------------------

@pytest.mark.parametrize("host", [0, 64])
def test_a_victim_of_this_round_waits_as_retracted(host):
    """§2: a victim's reason is that it was retracted this round, and for
    whom; with a host tier it is Retracted, without one it waits again."""
    p = Planner(config(page_size=4, total_pages=12, safe_steps=4, host_pages=host))
    for rid in ("old", "young", "third"):
        p.submit(req(rid, 4, max_new=40))
    victim = build_until_retracted(p).retracts[0].req
    assert isinstance(victim.state, Retracted if host else Waiting)
    r = reasons(p)[victim.id]
    assert r.reason == "retracted" and "for old" in r.detail


def test_prompts_behind_a_retraction_grant_wait_for_the_next_round():
    """§2: the victim was the blocker, so its room went to the first waiting
    prompt; whoever waits behind that grant waits for the next round."""
    p = Planner(config(page_size=4, total_pages=12, max_scheduled_tokens=64, safe_steps=4))
    p.submit(req("a", 20, max_new=24))
    p.submit(req("b", 4, max_new=20))
    step(p)
    p.submit(req("w", 16, max_new=1))             # 5 pages: does not fit until a goes
    p.submit(req("z", 1, max_new=1))
    plan = build_until_retracted(p)
    assert [r.req.id for r in plan.retracts] == ["a"]
    assert [op.req.id for op in plan.prefills] == ["w"]
    rs = reasons(p)
    assert "w" not in rs                          # granted
    assert rs["z"].reason == "retraction_grant" and rs["z"].blocked_by == "w"
    assert rs["a"].reason == "retracted"


@pytest.mark.parametrize("host", [0, 64])
def test_the_liveness_last_resort_victim_names_it_and_the_rule_that_holds_it_now(host):
    """§2's last resort: a round that would build nothing retracts one victim
    and runs the phases again; the victim yields to the request it was
    retracted for, so the second pass does not try it, and its reason names
    the last resort."""
    p = Planner(config(page_size=4, total_pages=12, safe_steps=4, host_pages=host))
    p.submit(req("a", 4, max_new=40))
    p.submit(req("b", 4, max_new=40))
    step(p)
    for r in p.running.values():                  # as in test_scheduler_retraction
        r.state.res.covers_generation = True
    plan = build_until_retracted(p)
    assert p.stalls and [r.req.id for r in plan.retracts] == ["b"]
    b = reasons(p)["b"]
    assert b.reason == "retracted" and "liveness last resort" in b.detail


def test_outside_mixed_mode_a_granted_prompt_waits_out_the_decode_round():
    """Non-mixed (§3.3): retraction freed room for r0, but a prefill cannot
    join a round that carries decodes; it waits for a decode-free round."""
    p = Planner(config(page_size=4, total_pages=12, safe_steps=4,
                       enable_mixed_prefill_decode=False))
    p.submit(req("r1", 24, max_new=12))
    p.submit(req("r2", 14, max_new=13))
    for _ in range(5):
        step(p)
    p.submit(req("r0", 1, max_new=15))
    plan = p.build()
    assert [r.req.id for r in plan.retracts] == ["r1"] and plan.decodes
    rs = reasons(p)
    assert rs["r0"].reason == "decode_round" and rs["r0"].blocked_by is None
    assert rs["r1"].reason == "retracted"


def test_p_capacity_waits_say_p_never_retracts():
    """§3.1: on P a prompt that does not fit waits for capacity; P never
    retracts, its pages come back with the peer's acks."""
    p = p_planner(page_size=4, total_pages=8, max_scheduled_tokens=64)
    for rid in "abc":
        p.submit(req(rid, 12))                    # 4 pages each: two fit
    p.build()
    c = reasons(p)["c"]
    assert c.reason == "capacity" and (c.pages_needed, c.pages_free) == (4, 0)
    assert "P never retracts" in c.detail


# ---- D (§3.2) ---------------------------------------------------------------------

def test_d_requests_remote_prefilling_on_p_wait_for_prefill():
    """D: a request whose prompt a P engine is prefilling waits for its
    landing; once it lands it is running and has no reason."""
    d = d_planner()
    d.submit(req("a", 8))
    step(d)
    assert reasons(d)["a"].reason == "waiting_for_prefill"
    d.transfer_landed("a", 7)
    assert reasons(d) == {}


def test_d_admits_one_remote_prefill_a_round_the_rest_wait_for_the_limit():
    """D: at most one remote admission a round; those behind it wait."""
    d = d_planner()
    for rid in "abc":
        d.submit(req(rid, 8))
    d.build()
    rs = reasons(d)
    assert rs["a"].reason == "waiting_for_prefill"
    for rid in "bc":
        assert rs[rid].reason == "remote_admission_limit" and rs[rid].blocked_by == "a"


def test_d_remote_admission_that_does_not_fit_waits_for_capacity():
    """D: a remote admission reserves the whole prompt plus headroom; one that
    does not fit waits for capacity with its pages."""
    d = d_planner(page_size=4, total_pages=12, safe_steps=4)
    d.submit(req("a", 20, max_new=4))             # 6 pages
    step(d)
    d.submit(req("b", 24, max_new=4))             # 7 pages; 6 free
    d.build()
    b = reasons(d)["b"]
    assert b.reason == "capacity" and (b.pages_needed, b.pages_free) == (7, 6)


def test_d_local_recovery_holds_remote_admissions_while_it_claims_the_round():
    """D (§3.2): a local recovery chunk claims the round to itself, so the
    prompt waiting for a remote admission waits for it."""
    d = d_planner(page_size=4, max_scheduled_tokens=8)
    d.submit(req("r", 40, max_new=4))
    step(d)
    d.transfer_failed("r", "peer lost")
    d.submit(req("w", 8))
    for _ in range(2):                            # the readmission, then a resident chunk
        plan, _ = step(d)
        assert [op.req.id for op in plan.prefills] == ["r"] and not plan.remote_prefills
        w = reasons(d)["w"]
        assert w.reason == "local_recovery" and w.blocked_by == "r"


def test_requests_that_arrived_after_the_last_build_are_not_yet_planned():
    """A submission, or a transfer failure, after the last build() has not
    been through the phases yet."""
    p = Planner(config())
    p.submit(req("a", 4))
    assert reasons(p)["a"].reason == "not_yet_planned"
    d = d_planner()
    d.submit(req("r", 8))
    step(d)
    d.transfer_failed("r", "peer lost")
    d.submit(req("late", 8))
    rs = reasons(d)
    assert rs["r"].reason == "not_yet_planned" and rs["late"].reason == "not_yet_planned"


def test_reasons_are_stable_strings():
    assert Hold.CAPACITY == "capacity" and str(Hold.BUDGET) == "budget"
    assert {h.value for h in Hold} >= {
        "behind_incomplete_prefill", "budget", "capacity", "sliding_room", "readmission_seal",
        "waiting_for_prefill", "remote_admission_limit"}


# ---- random workloads ---------------------------------------------------------

def check_reasons(p) -> None:
    """Exactly one reason for each waiting, retracted and landing request,
    and each reason consistent with itself and with FIFO."""
    out = p.waiting_reasons()
    ids = [r.req_id for r in out]
    want = [r.id for r in p.waiting] + list(p.retracted) + list(p.landing)
    assert sorted(ids) == sorted(want) and len(set(ids)) == len(ids), (out, want)
    line = []
    for r in out:
        assert isinstance(r.reason, Hold) and r.detail and r.blocked_by != r.req_id
        if r.pages_needed is not None:
            assert r.reason in ("capacity", "sliding_room") and r.blocked_by is None
            assert r.pages_needed > r.pages_free >= 0
        if r.req_id in p.requests and isinstance(p.requests[r.req_id].state, Waiting) \
                and r.reason not in ("retracted", "yields", "not_yet_planned"):
            line.append(r.reason)
    # nobody overtakes the request a phase stopped at: the line waits by one rule
    # (a victim that yields to the request it was retracted for steps aside, §2)
    assert len(set(line)) <= 1, out


@settings()
@given(workloads())
def test_random_fused_workloads_give_every_waiting_request_exactly_one_reason(w):
    cfg, reqs, _, groups = w
    _drive_fused(cfg, [(rid, prompt, m, arrive, False) for rid, prompt, m, arrive, _ in reqs],
                 groups)


@settings()
@given(tight_workloads())
def test_random_tight_workloads_give_every_waiting_request_exactly_one_reason(w):
    _drive_fused(*w)


def _drive_fused(cfg, reqs, groups):
    p = Planner(cfg, groups=groups)
    pending = sorted(reqs, key=lambda r: r[3])
    for rnd in range(20000):
        while pending and pending[0][3] <= rnd:
            rid, prompt, max_new, _, strict = pending.pop(0)
            p.submit(req(rid, prompt, max_new=max_new, strict=strict))
        check_reasons(p)
        if not p.has_work() and not pending:
            break
        plan = p.build()
        check_reasons(p)
        p.apply(plan, result_for(plan))
    p.assert_idle()


@settings()
@given(pd_workloads())
def test_random_pd_workloads_give_every_waiting_request_exactly_one_reason(w):
    p_cfg, d_cfg, reqs, groups = w
    pair = PDPair(p_cfg, d_cfg, groups=groups)
    pending = sorted(reqs, key=lambda r: r[3])
    for rnd in range(20000):
        while pending and pending[0][3] <= rnd:
            rid, prompt, max_new, _, fate = pending.pop(0)
            pair.submit(req(rid, prompt, max_new=max_new))
            if fate == "fail":
                pair.fail_next.add(rid)
        if not (pending or pair.D.has_work() or pair.P.has_work() or pair.in_flight):
            break
        pair.tick()                 # D builds, P builds, then landings and failures arrive
        check_reasons(pair.D)
        check_reasons(pair.P)
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_the_stats_message_carries_each_waiting_request_and_its_rule():
    """What `pdserve stats` and gRPC Stats show: the rule's stable string and,
    for capacity, the pages needed against free."""
    from pdserve.engine.stats import waiting_requests_pb

    p = Planner(config(page_size=4, total_pages=20, max_scheduled_tokens=64))
    p.submit(req("big0", 40, max_new=4))
    p.submit(req("big1", 40, max_new=4))
    p.submit(req("small", 4, max_new=4))
    p.build()
    got = {w.request_id: w for w in waiting_requests_pb(p)}
    assert set(got) == {"big1", "small"}
    assert (got["big1"].reason, got["big1"].pages_needed, got["big1"].pages_free) == \
        ("capacity", 11, 9)
    assert got["small"].reason == "capacity" and got["small"].pages_needed == 0
    assert "big1" in got["small"].detail
