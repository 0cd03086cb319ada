"""Spec §3.1 (P) and §3.2 (D): the roles' grammars and the handoff between
them, from both sides, ending with no page held anywhere."""

import pytest

from pdserve.scheduler import Planner, RejectedRequest
from pdserve.scheduler.fsm import (
    Decoding, Prefilling, RemotePrefillDone, RemotePrefilling, Retracted, Transferring,
    pd_pinned)
from pdserve.scheduler.round.grammar import Role

from support.pd import PDPair
from support.planner import config, req, result_for, step


def p_planner(**kw):
    return Planner(config(**kw), Role.PREFILL)


def d_planner(**kw):
    return Planner(config(**kw), Role.DECODE)


# ---- P (§3.1) ----------------------------------------------------------------

def test_p_ships_completed_prompts_before_feeding_more_prompt_work():
    p = p_planner(max_scheduled_tokens=16)
    p.submit(req("a", 10))
    p.submit(req("b", 40))
    plan, _ = step(p)                           # a completes, b gets its first chunk
    assert [op.req.id for op in plan.prefills] == ["a", "b"]
    plan, _ = step(p)
    assert [op.req.id for op in plan.remote_decodes] == ["a"]
    assert isinstance(p.requests["a"].state, Transferring)


def test_p_reserves_only_the_decode_slot():
    p = p_planner(page_size=4, safe_steps=4096)
    p.submit(req("a", 8, max_new=1000))
    step(p)
    # 8 prompt tokens + 1 decode slot = 3 pages: no admission headroom on P
    assert len(p.requests["a"].state.res.tables[0]) == 3


def test_p_pins_every_page_holding_state_until_the_ack_releases_it_wholesale():
    p = p_planner(page_size=4, total_pages=16, max_scheduled_tokens=8)
    p.submit(req("a", 12))
    seen = []
    for _ in range(4):
        step(p)
        r = p.requests["a"]
        seen.append(type(r.state))
        assert pd_pinned(r, role_is_prefill=True)
    assert Prefilling in seen and Transferring in seen
    held = p.cfg.total_pages - p.free_pages()
    assert held == 4
    p.peer_ack("a")
    p.assert_idle()


def test_p_never_retracts_a_full_pool_just_waits():
    p = p_planner(page_size=4, total_pages=8, max_scheduled_tokens=64)
    for rid in "abc":
        p.submit(req(rid, 12))                    # 4 pages each: two fit
    for _ in range(5):
        plan, _ = step(p)
        assert plan.retracts == []
    assert "c" in [r.id for r in p.waiting]
    p.peer_ack("a")
    plan, _ = step(p)
    assert [op.req.id for op in plan.prefills] == ["c"]


def test_an_ack_before_the_transfer_releases_as_an_abort():
    p = p_planner(max_scheduled_tokens=8)
    p.submit(req("a", 40))
    step(p)
    p.peer_ack("a")                               # D gave up on it mid-prefill
    assert p.requests == {} 
    p.assert_idle()


def test_p_ships_only_the_pages_the_peer_does_not_hold():
    p = p_planner(page_size=4)
    r = req("a", 18)
    r.first_page = 2
    p.submit(r)
    step(p)
    plan, _ = step(p)
    (op,) = plan.remote_decodes
    table = r.state.res.tables[0]
    assert op.src_pages == table[2:5]             # pages 2, 3, 4 hold tokens 8..17


def test_p_ingest_ignores_the_generation_length_the_peer_decodes():
    p = p_planner(page_size=4, total_pages=8)
    p.submit(req("a", 20, max_new=5000))          # D's problem, not P's
    with pytest.raises(RejectedRequest):
        p.submit(req("b", 40))                    # the prompt itself cannot fit


# ---- D (§3.2) ----------------------------------------------------------------

def test_d_admits_at_most_one_remote_prefill_a_round_reserving_the_whole_prompt():
    d = d_planner(page_size=4, safe_steps=8)
    for rid in "abc":
        d.submit(req(rid, 10, max_new=20))
    plan = d.build()
    (op,) = plan.remote_prefills
    assert op.req.id == "a" and op.first_page == 0 and len(op.landing_pages) == 3
    st = d.requests["a"].state
    assert isinstance(st, RemotePrefilling) and pd_pinned(d.requests["a"], False)
    # 10 prompt tokens + headroom 8 = 18 tokens = 5 pages
    assert len(st.res.tables[0]) == 5
    d.apply(plan, result_for(plan))
    plan = d.build()
    assert [o.req.id for o in plan.remote_prefills] == ["b"]


def test_d_decodes_spend_no_token_budget():
    d = d_planner(page_size=4, total_pages=256, max_scheduled_tokens=4)
    for i in range(6):
        d.submit(req(f"r{i}", 3, max_new=10))
        plan, _ = step(d)
        d.transfer_landed(f"r{i}", 7)
    plan, _ = step(d)
    assert len(plan.decodes) == 6                 # more than the budget of 4


def test_a_landing_turns_into_a_decode_and_finishes_with_the_right_tokens():
    pair = PDPair()
    pair.submit(req("a", 9, max_new=5))
    pair.submit(req("b", 30, max_new=1))
    done = pair.run()
    assert sorted(r.id for r in done) == ["a", "b"]
    assert [len(r.output) for r in sorted(done, key=lambda r: r.id)] == [5, 1]
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_a_remote_prefill_done_request_decodes_next_round():
    d = d_planner(page_size=4)
    d.submit(req("a", 9, max_new=5))
    step(d)
    d.transfer_landed("a", 42)
    assert isinstance(d.requests["a"].state, RemotePrefillDone)
    plan, _ = step(d)
    assert [r.id for r in plan.decodes] == ["a"]
    assert isinstance(d.requests["a"].state, Decoding)
    assert d.requests["a"].output[:1] == [42]


def test_a_failed_transfer_releases_the_landing_pages_and_recovers_locally():
    pair = PDPair()
    pair.fail_next.add("a")
    pair.submit(req("a", 20, max_new=6))
    for _ in range(3):
        pair.tick()
        if isinstance(pair.D.requests.get("a") and pair.D.requests["a"].state, Retracted):
            break
    r = pair.D.requests["a"]
    assert isinstance(r.state, Retracted) and r.error == "injected transfer failure"
    plan, _ = pair.tick()
    assert r in plan.readmits                     # local recovery: alone in its batch
    assert [op.req for op in plan.prefills] == [r] and not plan.decodes
    done = pair.run()
    assert [x.id for x in done] == ["a"] and len(r.output) == 6
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_local_recovery_claims_the_round_to_itself():
    d = d_planner(page_size=4, max_scheduled_tokens=8)
    d.submit(req("busy", 4, max_new=50))
    step(d)
    d.transfer_landed("busy", 1)
    step(d)
    d.submit(req("r", 40, max_new=4))
    step(d)
    d.transfer_failed("r", "peer lost")
    for _ in range(3):
        plan, _ = step(d)
        if any(op.req.id == "r" for op in plan.prefills):
            assert plan.decodes == [] and plan.remote_prefills == []


def test_a_d_prefix_hit_lands_only_the_rest():
    pair = PDPair()
    prompt = list(range(1, 41))
    pair.submit(req("a", prompt, max_new=2))
    pair.run()
    pair.submit(req("b", prompt + [7, 7, 7], max_new=2))
    dplan, _ = pair.tick()
    (op,) = dplan.remote_prefills
    assert op.first_page == 10                    # the 40 cached tokens: 10 pages
    pair.run()
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_abort_on_d_while_the_peer_prefills_releases_both_sides():
    pair = PDPair(p_cfg=config(max_scheduled_tokens=8))
    pair.submit(req("a", 40, max_new=4))
    pair.tick()
    pair.D.abort("a")
    pair.P.peer_ack("a")                          # the cluster forwards the abort
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_a_lost_ack_holds_p_pages_until_the_lease_lets_go():
    pair = PDPair(lease_rounds=5)
    pair.lose_ack.add("a")
    pair.submit(req("a", 10, max_new=3))
    held = []                       # P's used pages each tick, from the tick D had the KV
    while pair.D.has_work() or pair.P.has_work() or pair.in_flight:
        pair.tick()
        if "a" in pair.leased:                  # P still waits for the ack
            assert "a" in pair.P.requests and \
                isinstance(pair.P.requests["a"].state, Transferring)
        if held or "a" in pair.leased:
            held.append(pair.P.total_pages - pair.P.free_pages())
    assert [r.id for r in pair.finished] == ["a"]
    # the ack never came: P kept every page of the 10-token prompt (3 pages
    # of 4) pinned for the 5 ticks of its lease, and none after it
    assert held == [3] * 5 + [0]
    pair.P.assert_idle()


def test_d_retracts_decodes_and_recovers_them_locally():
    pair = PDPair(d_cfg=config(page_size=4, total_pages=16, safe_steps=4))
    for rid in "abc":
        pair.submit(req(rid, 8, max_new=30))
    done = pair.run()
    assert sorted(r.id for r in done) == ["a", "b", "c"]
    assert all(len(r.output) == 30 for r in done)
    assert sum(r.retractions for r in done) > 0
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_every_event_from_every_state_leaves_nothing_unowned():
    d = d_planner(page_size=4)
    d.submit(req("w", 8))
    d.abort("w")                                   # Waiting -> Aborted
    d.submit(req("x", 8))
    step(d)
    d.abort("x")                                   # RemotePrefilling -> Aborted
    d.submit(req("y", 8))
    step(d)
    d.transfer_failed("y", "timeout")              # RemotePrefilling -> Retracted
    d.abort("y")                                   # Retracted -> Aborted
    d.submit(req("z", 8, max_new=1))
    step(d)
    assert [r.id for r in d.transfer_landed("z", 3)] == ["z"]   # one token: done
    d.assert_idle()
    p = p_planner(page_size=4, max_scheduled_tokens=4)
    for rid in "abc":
        p.submit(req(rid, 8))
    step(p)
    p.peer_ack("a")                                # Prefilling -> Aborted
    p.abort("c")                                   # Waiting -> Aborted
    while not isinstance(p.requests["b"].state, Transferring):
        step(p)
    p.abort("b", "peer lost")                      # Transferring -> Aborted (lease)
    p.assert_idle()


def test_a_fenced_landing_is_not_reused_until_the_fence_is_released():
    d = d_planner(page_size=4, total_pages=6, safe_steps=4)
    d.submit(req("a", 12, max_new=4))             # 12 + 4 headroom: 4 pages
    step(d)
    d.transfer_failed("a", "timeout", fence_key=("a", 1))
    assert d.held_by_fences() == 4 and d.free_pages() == 2
    d.abort("a")                                  # the request goes; the fence stays
    d.submit(req("b", 12, max_new=4))
    plan, _ = step(d)
    assert plan.remote_prefills == []             # only 2 pages: b must wait
    d.release_fence(("a", 1))                     # the late write drained
    plan, _ = step(d)
    assert [op.req.id for op in plan.remote_prefills] == ["b"]
    d.abort("b")
    d.assert_idle()


def test_d_never_prefills_a_new_prompt_itself_even_when_retraction_grants_it_room():
    # a tight D pool retracts decodes; the room a victim frees goes to the next
    # prompt as a remote admission (P prefills it), never as a local chunk
    pair = PDPair(d_cfg=config(page_size=4, total_pages=16, safe_steps=4))
    for i in range(6):
        pair.submit(req(f"r{i}", 8, max_new=30))
    asked_p = set()
    for _ in range(5000):
        if not (pair.D.has_work() or pair.P.has_work() or pair.in_flight):
            break
        recovering = {r.id for r in pair.D.requests.values()
                      if isinstance(r.state, (Retracted, Prefilling))}
        dplan, pplan = pair.tick()
        asked_p |= {op.req.id for op in dplan.remote_prefills}
        for op in dplan.prefills:
            assert op.req.id in recovering or op.req in dplan.readmits, \
                f"D prefilled new prompt {op.req.id} locally"
            assert not dplan.decodes, "a D prefill chunk beside its decode batch"
    assert asked_p == {f"r{i}" for i in range(6)}
    pair.D.assert_idle()
    pair.P.assert_idle()
