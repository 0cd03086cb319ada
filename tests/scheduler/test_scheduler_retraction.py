"""Spec §2 and §4: retraction, recovery and the host (L2) cache, one rule a
test, plus the peer's shared-prefix deadlock repro and a thrash check."""

import math

import pytest

from pdserve.scheduler import Planner
from pdserve.scheduler.fsm import Prefilling, Retracted, Waiting
from pdserve.scheduler.round.retraction import choose_victim

from support.planner import config, req, result_for, run_to_completion, step


def tight(host=0, **kw):
    base = dict(page_size=4, total_pages=12, max_scheduled_tokens=64, safe_steps=4,
                host_pages=host)
    base.update(kw)
    return Planner(config(**base))


def decode_until_blocked(p, max_rounds=200):
    """Run until a round retracts someone; return that plan."""
    for _ in range(max_rounds):
        plan, _ = step(p)
        if plan.retracts:
            return plan
    raise AssertionError("nothing was ever retracted")


def test_no_retraction_while_a_prefill_progresses():
    # d decodes past its 2-page reserve while L, admitted behind it with the
    # rest of the pool reserved, is still prefilling: d is blocked, yet L's
    # chunks are progress, so nobody is retracted
    p = Planner(config(page_size=4, total_pages=13, max_scheduled_tokens=8, safe_steps=4))
    p.submit(req("d", 4, max_new=20))
    p.submit(req("L", 40, max_new=1))
    blocked_rounds = 0
    while isinstance(p.requests.get("L") and p.requests["L"].state, (Waiting, Prefilling)):
        plan, _ = step(p)
        if "d" not in [r.id for r in plan.decodes] and plan.round > 1:
            blocked_rounds += 1
            assert plan.prefills and not plan.retracts
    assert blocked_rounds >= 3


def test_retraction_grants_the_blocker_in_the_same_round():
    p = tight()
    p.submit(req("old", 4, max_new=40))
    p.submit(req("young", 4, max_new=40))
    p.submit(req("third", 4, max_new=40))
    plan = decode_until_blocked(p)
    (victim,) = [r.req for r in plan.retracts]
    assert victim.id != "old"
    # the blocker got its page in the same plan and decodes in this round
    assert "old" in [r.id for r in plan.decodes]
    assert victim.retractions == 1


def test_a_victim_that_is_the_blocker_gives_its_room_to_the_first_waiting_prompt():
    # a (big) and b (small) grow in step until both are blocked; a frees the
    # most, so a is the victim and also the blocker: its pages go to w
    p = Planner(config(page_size=4, total_pages=12, max_scheduled_tokens=64, safe_steps=4))
    p.submit(req("a", 20, max_new=24))
    p.submit(req("b", 4, max_new=20))
    step(p)
    p.submit(req("w", 16, max_new=1))        # 5 pages: does not fit until a goes
    plan = decode_until_blocked(p)
    assert [r.req.id for r in plan.retracts] == ["a"]
    assert [op.req.id for op in plan.prefills] == ["w"]
    assert isinstance(p.requests["a"].state, Waiting)
    run_to_completion(p)
    p.assert_idle()


def test_incomplete_prefills_are_chosen_before_decode_work():
    p = Planner(config(page_size=4, total_pages=256, max_scheduled_tokens=8, safe_steps=4))
    p.submit(req("dec", 4, max_new=40))
    step(p)
    p.submit(req("pre", 40, max_new=40))
    step(p)
    assert isinstance(p.requests["pre"].state, Prefilling)
    assert choose_victim(p).id == "pre"


def test_decode_victims_rank_by_releasable_pages_then_fewest_tokens():
    p = Planner(config(page_size=4, total_pages=256, safe_steps=4))
    p.submit(req("short", 4, max_new=40))
    p.submit(req("long", 20, max_new=40))
    p.submit(req("same", 4, max_new=40))
    step(p)
    # long holds the most pages of its own
    assert choose_victim(p).id == "long"
    p.abort("long")
    # short and same hold equal pages and tokens: the younger goes
    assert choose_victim(p).id == "same"


def test_a_request_whose_reserve_covers_its_generation_is_never_a_victim():
    p = Planner(config(page_size=4, total_pages=256, safe_steps=4))
    p.submit(req("covered", 4, max_new=4))      # 4 <= safe_steps: whole generation reserved
    p.submit(req("strict", 4, max_new=40, strict=True))
    p.submit(req("open", 4, max_new=40))
    step(p)
    assert choose_victim(p).id == "open"
    p.abort("open")
    assert choose_victim(p) is None


def test_the_exemption_is_judged_against_the_budget_open_at_admission():
    # headroom 4 of a 12-token budget: after 9 tokens the remainder (3) is
    # under the window, but the admission never covered the generation
    p = Planner(config(page_size=4, total_pages=256, safe_steps=4))
    p.submit(req("a", 4, max_new=12))
    for _ in range(9):
        step(p)
    r = p.requests["a"]
    assert r.remaining_new_tokens < 4
    assert choose_victim(p) is r


def test_a_victim_with_a_forward_in_flight_makes_retraction_wait():
    def scenario():
        p = tight()
        for rid in "abc":
            p.submit(req(rid, 4, max_new=40))
        return p
    p, rounds = scenario(), 0
    while True:
        plan, _ = step(p)
        rounds += 1
        if plan.retracts:
            victim = plan.retracts[0].req.id
            break
    # the same history, but the chosen victim still has a forward out
    q = scenario()
    for _ in range(rounds - 1):
        step(q)
    q.requests[victim].state.res.forwards_out += 1
    plan = q.build()
    assert plan.retracts == []           # it waits; no worse-ranked request is taken


def test_a_pinned_store_in_flight_defers_all_retraction():
    # pinned stores ack one round late (their own stream): a round that
    # starts with one outstanding never retracts, and everything still ends
    p = tight(host=64)
    for rid in "abc":
        p.submit(req(rid, 4, max_new=40))
    late, gated, retracted = [], 0, 0
    while p.has_work():
        plan = p.build()
        if late:
            gated += 1
            assert not plan.retracts
        retracted += len(plan.retracts)
        res = result_for(plan, ack=False)
        res.stores_done = [s.id for s in plan.stores if not s.pinned] + late
        res.loads_done = [ld.id for ld in plan.loads]
        p.apply(plan, res)
        late = [s.id for s in plan.stores if s.pinned]
        p.check_invariants()
    assert gated and retracted
    p.assert_idle()


def test_readmission_order_puts_generations_first_then_the_oldest_epoch():
    p = Planner(config(host_pages=16))
    rs = [req(f"r{i}", 4) for i in range(3)]
    for r in rs:
        p.submit(r)
    p.waiting.clear()
    # hand-built retracted states: r0 prefill-only, r1 and r2 with output
    for r, (epoch, gen) in zip(rs, [(1, False), (3, True), (2, True)]):
        r.state = Retracted(epoch, gen, [], 0, 4)
        p.retracted[r.id] = r
    assert p.next_readmission().id == "r2"
    del p.retracted["r2"]
    assert p.next_readmission().id == "r1"
    del p.retracted["r1"]
    assert p.next_readmission().id == "r0"


def test_with_a_host_cache_a_victim_is_snapshotted_and_loaded_back():
    p = tight(host=64)
    p.submit(req("a", 6, max_new=30))
    p.submit(req("b", 6, max_new=30))
    p.submit(req("c", 6, max_new=30))
    plan = decode_until_blocked(p)
    (rop,) = plan.retracts
    victim = rop.req
    assert rop.stored and isinstance(victim.state, Retracted)
    snap = [s for s in plan.stores if not s.pinned]
    assert len(snap) == 1 and len(snap[0].host_pages) == len(victim.state.snapshot[0])
    assert plan.stores[0] is snap[0]                 # stream-ordered store runs first
    tokens_before = victim.num_tokens
    for _ in range(500):
        plan, _ = step(p)
        if victim in plan.readmits:
            break
    assert plan.loads                                # the snapshot came back
    # resumed, not recomputed: only the sampled token it had not fed yet runs
    assert [(op.begin, op.tokens) for op in plan.prefills if op.req is victim] == \
        [(tokens_before - 1, 1)]
    run_to_completion(p)
    assert len(victim.output) == 30
    p.assert_idle()


def test_without_a_host_cache_a_victim_re_prefills_its_whole_history():
    p = tight()
    for rid in ("a", "b", "c"):
        p.submit(req(rid, 6, max_new=30))
    plan = decode_until_blocked(p)
    victim = plan.retracts[0].req
    assert not plan.retracts[0].stored and isinstance(victim.state, Waiting)
    history = victim.num_tokens
    for _ in range(500):
        plan, _ = step(p)
        ops = [op for op in plan.prefills if op.req is victim]
        if ops:
            break
    assert ops[0].begin + sum(op.tokens for op in ops) <= history
    run_to_completion(p)
    assert len(victim.output) == 30
    p.assert_idle()


def test_readmission_escalates_headroom_by_one_window_per_retraction():
    p = tight(host=64, total_pages=40)
    for rid in "abc":
        p.submit(req(rid, 4, max_new=60))
    plan = decode_until_blocked(p)
    victim = plan.retracts[0].req
    while victim not in plan.readmits:
        plan, _ = step(p)
    res = victim.state.res
    # the readmission round also ran its one-token completing chunk
    history = victim.num_tokens - 1
    remaining = victim.max_new_tokens - (len(victim.output) - 1)
    # readmitted with headroom min(remaining, safe_steps * (1 + 1 retraction))
    want = history + min(remaining, 4 * 2)
    assert want <= len(res.tables[0]) * 4 < want + 4


def test_a_readmission_that_does_not_fit_waits_and_holds_new_prompts_back():
    p = tight(host=64, total_pages=12)
    for rid in "abc":
        p.submit(req(rid, 6, max_new=30))
    plan = decode_until_blocked(p)
    victim = plan.retracts[0].req
    p.submit(req("new", 2, max_new=1))
    saw_wait = False
    for _ in range(500):
        plan, _ = step(p)
        if isinstance(victim.state, Retracted):
            saw_wait = True
            assert "new" not in [op.req.id for op in plan.prefills]
            assert all(r.req is not victim for r in plan.retracts)
        else:
            break
    assert saw_wait
    run_to_completion(p)
    p.assert_idle()


def test_at_most_one_readmission_a_round():
    p = tight(host=64, total_pages=16)
    for i in range(5):
        p.submit(req(f"r{i}", 4, max_new=40))
    while p.has_work():
        plan, _ = step(p)
        assert len(plan.readmits) <= 1
    p.assert_idle()


def test_publications_are_pinned_stores_that_fill_the_host_index():
    p = Planner(config(page_size=4, total_pages=64, host_pages=64))
    p.submit(req("a", list(range(1, 17)), max_new=2))
    plan = p.build()
    p.apply(plan, result_for(plan))
    plan = p.build()                              # first decode publishes the prompt
    pinned = [s for s in plan.stores if s.pinned]
    assert pinned and sum(len(s.device_pages) for s in pinned) == 4
    rc = p.coord.groups[0].pool.refcount
    assert all(rc[pg] >= 2 for s in pinned for pg in s.device_pages)  # request + pin
    p.apply(plan, result_for(plan, ack=False))
    assert p.coord.host.index.num_cached == 0     # not before the ack
    for s in pinned:
        p.coord.store_done(s.id)
    assert p.coord.host.index.num_cached == 4
    p.check_invariants()
    run_to_completion(p)
    p.assert_idle()


def test_a_prefix_evicted_from_the_device_is_loaded_back_from_host():
    p = Planner(config(page_size=4, total_pages=8, host_pages=64, max_scheduled_tokens=64))
    prompt = list(range(1, 17))
    p.submit(req("a", prompt, max_new=2))
    run_to_completion(p)
    p.submit(req("flush", list(range(100, 128)), max_new=4))   # evicts a's pages
    run_to_completion(p)
    assert p.coord.match(req("probe", prompt), 3).device_end == 0
    p.submit(req("b", prompt + [99], max_new=2))
    plan = p.build()
    assert plan.loads and sum(len(ld.host_pages) for ld in plan.loads) == 4
    assert [(op.begin, op.tokens) for op in plan.prefills] == [(16, 1)]
    p.apply(plan, result_for(plan))
    run_to_completion(p)
    p.assert_idle()


def test_strict_requests_reserve_their_whole_generation_and_are_never_retracted():
    p = tight(total_pages=40)
    p.submit(req("s", 4, max_new=40, strict=True))
    for rid in "abc":
        p.submit(req(rid, 4, max_new=40))
    step(p)
    s = p.requests["s"]
    assert s.capacity >= 4 + 40
    while p.has_work():
        plan, _ = step(p)
        assert all(r.req is not s for r in plan.retracts)
    assert s.retractions == 0
    p.assert_idle()


def test_liveness_last_resort_retracts_an_exempt_request_when_nothing_else_moves():
    p = tight()
    p.submit(req("a", 4, max_new=40))
    p.submit(req("b", 4, max_new=40))
    step(p)
    # pretend both admissions had covered their generations: when the pool
    # fills, no victim is eligible and a round would build nothing
    for r in p.running.values():
        r.state.res.covers_generation = True
    for _ in range(100):
        plan, _ = step(p)
        if p.stalls:
            break
    assert p.stalls and "built nothing" in p.stalls[0]
    assert len(plan.retracts) == 1 and not plan.is_empty()
    run_to_completion(p)
    p.assert_idle()


@pytest.mark.parametrize("host", [0, 128])
@pytest.mark.parametrize("safe_steps", [4096, 8])
def test_peer_deadlock_repro_32_requests_sharing_a_59_page_prompt_in_96_pages(host, safe_steps):
    # seeds/003: 32 requests share a 59-page prompt in a 96-page pool
    p = Planner(config(page_size=16, total_pages=96, max_scheduled_tokens=2048,
                       max_batch_size=32, safe_steps=safe_steps, host_pages=host))
    shared = [7 + (i % 5000) for i in range(59 * 16)]
    for i in range(32):
        p.submit(req(f"r{i}", shared, max_new=64))
    done = run_to_completion(p)
    assert len(done) == 32 and all(len(r.output) == 64 for r in done)
    p.assert_idle()


def test_two_requests_that_cannot_fit_together_never_evict_each_other_in_a_cycle():
    # each needs 10 of 12 pages at the end; they fit together only early on
    for host in (0, 64):
        p = tight(host=host, total_pages=12, safe_steps=4)
        p.submit(req("x", 8, max_new=32))
        p.submit(req("y", 8, max_new=32))
        victims = []
        while p.has_work():
            plan, _ = step(p)
            victims += [r.req.id for r in plan.retracts]
        # a cycle would be x, y, x, ...: each may be retracted, but not back and forth
        swaps = sum(1 for a, b in zip(victims, victims[1:]) if a != b)
        assert swaps <= 1, victims
        for rid in "xy":
            assert victims.count(rid) <= math.ceil(32 / 4)
        p.assert_idle()


def test_a_redirected_grant_respects_a_waiting_readmission():
    from pdserve.scheduler.round.build import PlanBuild
    from pdserve.scheduler.plan import Plan
    from pdserve.scheduler.round.retraction import _grant_first_waiting

    p = tight()
    p.submit(req("w", 4, max_new=2))
    b = PlanBuild(Plan(1), 64, 8, decodes_use_budget=True, mixed=True)
    b.new_prompts_sealed = True                   # a readmission is waiting for room
    _grant_first_waiting(p, b, victim=None)
    assert b.plan.prefills == [] and isinstance(p.requests["w"].state, Waiting)


def test_a_failed_round_aborts_what_it_touched_and_leaves_the_rest_running():
    p = tight(host=64, total_pages=40, max_batch_size=2)
    p.submit(req("a", 6, max_new=30))
    step(p)
    p.submit(req("b", 6, max_new=30))
    p.submit(req("c", 6, max_new=30))
    plan = p.build()                              # a decodes, b prefills, c waits (batch full)
    assert {r.id for r in plan.decodes} == {"a"} and [o.req.id for o in plan.prefills] == ["b"]
    with pytest.raises(Exception, match="forward in flight"):
        p.abort("a")                              # refused, and nothing changed
    assert "a" in p.running
    failed = p.fail_plan(plan, "engine error: boom")
    assert {r.id for r in failed} == {"a", "b"}
    assert all(r.error == "engine error: boom" for r in failed)
    p.check_invariants()
    # c, which the round never touched, is still queued, unharmed, and served to the end
    assert set(p.requests) == {"c"} and isinstance(p.requests["c"].state, Waiting)
    done = run_to_completion(p)
    assert [r.id for r in done] == ["c"] and len(done[0].output) == 30 and not done[0].error
    p.assert_idle()


def test_an_executor_that_raises_fails_its_round_cleanly():
    from pdserve.engine.engine import Engine

    class Broken:
        def run(self, plan):
            raise RuntimeError("device lost")
    p = tight()
    p.submit(req("a", 6, max_new=3))
    out = Engine("e", p, Broken()).step()
    assert [r.id for r in out.failed] == ["a"] and "device lost" in out.error
    p.assert_idle()
