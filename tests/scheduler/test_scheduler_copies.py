"""Ownership of pages under an in-flight copy (issue 34): a page that an
unacked load, store or transfer reads or writes is held by the copy's
ticket until the ack (or failure) comes back, however many rounds later,
and released then. Nothing else may free it or be granted it meanwhile;
an abort takes effect for those pages at the ack. Each test withholds an
ack the way an asynchronous executor (CUDA `non_blocking` copies, a disk
prefetch) reports it: rounds after the plan that asked for the copy."""

import dataclasses

import pytest

from pdserve.config import ConfigError, SimulateConfig
from pdserve.scheduler import Planner
from pdserve.scheduler.cache.groups import FULL, CacheGroupSpec
from pdserve.scheduler.fsm import Retracted
from pdserve.scheduler.plan import Plan, StepResult
from pdserve.sim.simulation import Simulation

from support.planner import config, req, result_for, run_to_completion


def tight_with_host(**kw):
    base = dict(page_size=4, total_pages=12, max_scheduled_tokens=64, safe_steps=4,
                host_pages=64)
    base.update(kw)
    return Planner(config(**base))


def late_acks(p: Planner, stores=(), loads=()) -> None:
    """The executor reports copies done after their round: an ack with no forward."""
    p.apply(Plan(p.round), StepResult(stores_done=list(stores), loads_done=list(loads)))
    p.check_invariants()


def run_until(p: Planner, cond, max_rounds: int = 500) -> Plan:
    """Build rounds (acking everything in-round) until a plan meets `cond`;
    return that plan, built and not applied."""
    for _ in range(max_rounds):
        plan = p.build()
        if cond(plan):
            return plan
        p.apply(plan, result_for(plan))
        p.check_invariants()
    raise AssertionError("no round met the condition")


def test_a_load_target_is_not_granted_again_in_the_same_plan():
    """Defect 4 (full history beside a state group): the readmission's
    device hit is cut back to the state checkpoint below the cached chain,
    so it loads its snapshot into fresh pages, and its next chunk's
    publication adopts the cached twins of those slots. The load still
    writes its own pages: they stay the load's until the ack, and the
    prompt admitted after it in the same plan gets other pages."""
    cfg = config(page_size=4, total_pages=23, safe_steps=4, host_pages=64,
                 max_scheduled_tokens=12, max_batch_size=2, state_slots=8,
                 enable_mixed_prefill_decode=False)
    p = Planner(cfg, groups=(FULL, CacheGroupSpec("snapshot_state", block=8)))
    arrivals = [(4, req("r3", [7] * 12, max_new=16)),
                (5, req("r4", [7] * 12 + [14, 13], max_new=7)),
                (10, req("r0", [1, 2, 3, 4, 5, 6, 7, 8, 3, 34, 21, 13, 16, 32, 41], max_new=23)),
                (10, req("r2", [7] * 12 + [16, 49, 17, 29, 31, 32, 18, 3], max_new=9))]
    readmissions = 0
    for rnd in range(400):
        while arrivals and arrivals[0][0] <= rnd:
            p.submit(arrivals.pop(0)[1])
        if not p.has_work() and not arrivals:
            break
        plan = p.build()
        assert len(set(plan.fresh_pages)) == len(plan.fresh_pages), \
            f"round {plan.round} grants a page twice: {plan.fresh_pages}"
        p.check_invariants()
        readmissions += len(plan.readmits)
        p.apply(plan, result_for(plan))
        p.check_invariants()
    assert readmissions, "the workload no longer readmits: the test lost its case"
    p.assert_idle()


def test_abort_leaves_an_unacked_loads_target_pages_to_the_load():
    """Defect 5: an abort during a load frees the request's pages except
    those the load writes; those go back when the load's ack comes."""
    p = tight_with_host()
    for rid in "abc":
        p.submit(req(rid, 6, max_new=30))
    plan = run_until(p, lambda plan: bool(plan.readmits and plan.loads))
    (victim,) = plan.readmits
    result = result_for(plan)
    result.loads_done = []                             # the loads are still copying
    p.apply(plan, result)
    targets = [(ld.group, pg) for ld in plan.loads for pg in ld.device_pages]
    p.abort(victim.id)
    assert all(p.coord.page_is_held(g, pg) for g, pg in targets)
    p.check_invariants()
    p.submit(req("d", 16, max_new=4))
    nxt = p.build()
    assert not {pg for _, pg in targets} & set(nxt.fresh_pages)
    p.apply(nxt, result_for(nxt))
    late_acks(p, loads=[ld.id for ld in plan.loads])
    run_to_completion(p)
    p.assert_idle()


def test_aborting_a_retracted_request_keeps_its_snapshot_pages_until_the_store_is_acked():
    """Defect 6: the snapshot's host pages are written by a store that has
    not reported back; aborting its owner lets go of the snapshot's hold,
    the store keeps its own until the ack."""
    p = tight_with_host()
    for rid in "abc":
        p.submit(req(rid, 6, max_new=30))
    plan = run_until(p, lambda plan: any(r.stored for r in plan.retracts))
    p.apply(plan, result_for(plan, ack=False))
    victim = next(r.req for r in plan.retracts if r.stored)
    snap = [s for s in plan.stores if not s.pinned]
    host = [(s.group, hp) for s in snap for hp in s.host_pages]
    p.abort(victim.id)
    assert all(p.coord.page_is_held(g, hp, host=True) for g, hp in host)
    p.check_invariants()
    late_acks(p, stores=[s.id for s in plan.stores], loads=[ld.id for ld in plan.loads])
    assert not any(p.coord.page_is_held(g, hp, host=True) for g, hp in host)
    run_to_completion(p)
    p.assert_idle()


def test_a_readmission_waits_for_its_snapshot_store_to_be_acked():
    """A load may not read host pages a store has not reported written:
    the victim is readmitted only once its snapshot's ack is back."""
    p = tight_with_host()
    for rid in "abc":
        p.submit(req(rid, 6, max_new=30))
    plan = run_until(p, lambda plan: any(r.stored for r in plan.retracts))
    p.apply(plan, result_for(plan, ack=False))
    victim = next(r.req for r in plan.retracts if r.stored)
    for _ in range(3):
        nxt = p.build()
        assert victim not in nxt.readmits and isinstance(victim.state, Retracted)
        p.apply(nxt, result_for(nxt))
        p.check_invariants()
    late_acks(p, stores=[s.id for s in plan.stores], loads=[ld.id for ld in plan.loads])
    plan = run_until(p, lambda plan: victim in plan.readmits)
    p.apply(plan, result_for(plan))
    run_to_completion(p)
    assert len(victim.output) == 30
    p.assert_idle()


def test_a_failed_round_gives_a_loads_targets_back_once():
    """fail_plan ends a round's copies: a load's ticket lets go of its
    targets and its sources exactly once, and its request is aborted."""
    p = tight_with_host()
    for rid in "abc":
        p.submit(req(rid, 6, max_new=30))
    plan = run_until(p, lambda plan: bool(plan.readmits and plan.loads))
    failed = p.fail_plan(plan, "injected")
    assert plan.readmits[0] in failed
    p.check_invariants()
    run_to_completion(p)
    p.assert_idle()


# ---- late acknowledgements as a mode of the simulator ---------------------------


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_ack_delay_rounds_is_an_integer_of_at_least_zero(bad):
    with pytest.raises(ConfigError, match="ack_delay_rounds"):
        SimulateConfig.from_dict({"ack_delay_rounds": bad})


@pytest.mark.parametrize("case", ["mooncake-tight-host", "mooncake-tight-pd-host",
                                  "gemma-sliding-host", "qwen3-next-state-host"])
def test_a_simulation_with_acks_three_rounds_late_finishes_everything_and_leaks_nothing(case):
    """The plan-hash workloads that retract to, load from and store to the
    host tier (and, P/D, land transfers), with every copy acked and every
    landing seen three rounds late: every request it admits finishes, no engine
    stalls, every planner ends idle."""
    from test_plan_log_hash import WORKLOADS

    cfg, trace = WORKLOADS[case]()
    cfg = dataclasses.replace(cfg, simulate=dataclasses.replace(cfg.simulate,
                                                                ack_delay_rounds=3))
    sim = Simulation(cfg, trace, progress=False)
    out = sim.run()
    # rejected: a prompt beyond the engine's bound, at submission, whatever the delay
    assert {r["status"] for r in out["requests"]} <= {"finished", "rejected"}
    for se in sim.engines:
        assert not se.stalled and not se.held_landings
        assert not se.engine.executor.acks_pending()
        se.planner.assert_idle()
