"""The fused role's grammar (spec §1.1, §3.3) and the request lifecycle."""

import pytest

from pdserve.scheduler import Planner
from pdserve.scheduler.fsm import Decoding, Prefilling

from support.planner import config, req, result_for, run_to_completion, step

K = 1024


def chunks(plan):
    return [(op.req.id, op.begin, op.tokens) for op in plan.prefills]


def test_worked_example_6k_budget_schedules_2k_1k_and_3k_of_10k_then_stops():
    p = Planner(config(page_size=16, total_pages=4096, max_scheduled_tokens=6 * K))
    for rid, n in (("a", 2 * K), ("b", 1 * K), ("c", 10 * K), ("d", 16)):
        p.submit(req(rid, n))
    plan = p.build()
    assert chunks(plan) == [("a", 0, 2 * K), ("b", 0, 1 * K), ("c", 0, 3 * K)]
    assert plan.prefills[-1].completes is False
    assert "d" not in [op.req.id for op in plan.prefills]


def test_incomplete_prefill_holds_the_line():
    p = Planner(config(max_scheduled_tokens=32))
    p.submit(req("long", 100))
    p.submit(req("short", 4))
    for _ in range(3):
        plan, _ = step(p)
        assert [op.req.id for op in plan.prefills] == ["long"]
        assert isinstance(p.requests["long"].state, Prefilling)


def test_completing_chunk_releases_the_line_within_the_round():
    p = Planner(config(max_scheduled_tokens=32))
    p.submit(req("long", 40))
    p.submit(req("short", 4))
    step(p)                                  # long: [0, 32)
    plan = p.build()
    # long completes with 8 tokens; short starts in the same round
    assert chunks(plan) == [("long", 32, 8), ("short", 0, 4)]


def test_a_prompt_the_leftover_budget_cannot_start_is_not_overtaken():
    # budget 10, page 4: seven decodes leave 3 tokens, too few for the long
    # prompt to reach a page boundary; the one-token prompt behind it would
    # fit, but must not jump the line.
    p = Planner(config(max_scheduled_tokens=10, page_size=4))
    for i in range(7):
        p.submit(req(f"d{i}", 1, max_new=50))
    step(p)
    p.submit(req("long", 100))
    p.submit(req("tiny", 1))
    plan, _ = step(p)
    assert len(plan.decodes) == 7 and plan.prefills == []


def test_mixed_round_decodes_first_then_spends_what_remains_on_prefill():
    p = Planner(config(max_scheduled_tokens=32))
    for i in range(3):
        p.submit(req(f"d{i}", 4, max_new=20))
    step(p)                                  # three prompts complete
    p.submit(req("new", 100))
    plan = p.build()
    assert [r.id for r in plan.decodes] == ["d0", "d1", "d2"]
    # 32 - 3 decode tokens = 29 left; the chunk aligns down to 28
    assert chunks(plan) == [("new", 0, 28)]


def test_non_mixed_prefill_runs_alone_and_decodes_wait_for_a_prefill_free_round():
    p = Planner(config(max_scheduled_tokens=32, enable_mixed_prefill_decode=False))
    p.submit(req("d0", 4, max_new=20))
    step(p)
    p.submit(req("new", 40))
    plan, _ = step(p)
    assert chunks(plan) == [("new", 0, 32)] and plan.decodes == []
    plan, _ = step(p)
    assert chunks(plan) == [("new", 32, 8)] and plan.decodes == []
    plan, _ = step(p)
    assert plan.prefills == [] and [r.id for r in plan.decodes] == ["d0", "new"]


def test_a_decode_inside_its_reserved_pages_does_no_allocator_work():
    p = Planner(config(page_size=4, total_pages=64))
    p.submit(req("a", 5, max_new=30))
    step(p)
    free = p.free_pages()
    for _ in range(10):
        plan, _ = step(p)
        assert plan.decodes and plan.fresh_pages == []
        assert p.free_pages() == free


def test_the_first_chunk_reserves_the_rest_of_the_prompt_plus_headroom():
    p = Planner(config(page_size=4, total_pages=256, max_scheduled_tokens=8, safe_steps=16))
    p.submit(req("a", 40, max_new=100))
    step(p)
    st = p.requests["a"].state
    assert isinstance(st, Prefilling)
    # 40 prompt tokens + min(100, 16) headroom = 56 tokens = 14 pages
    assert len(st.res.tables[0]) == 14
    step(p)                                  # later chunks need no new page
    assert len(p.requests["a"].state.res.tables[0]) == 14


def test_decode_past_the_reserve_takes_a_page_at_the_boundary():
    p = Planner(config(page_size=4, total_pages=256, safe_steps=4))
    p.submit(req("a", 4, max_new=20))
    step(p)                                  # 8 tokens reserved: 2 pages
    grew = []
    for _ in range(12):
        plan, _ = step(p)
        grew.append(len(plan.fresh_pages))
    assert sum(grew) >= 2 and all(g in (0, 1) for g in grew)


def test_new_prompts_are_admitted_in_fifo_order_and_a_blocked_one_is_not_overtaken():
    p = Planner(config(page_size=4, total_pages=20, max_scheduled_tokens=64))
    p.submit(req("big0", 40, max_new=4))     # 11 pages
    p.submit(req("big1", 40, max_new=4))     # does not fit beside big0
    p.submit(req("small", 4, max_new=4))     # would fit, but must wait behind big1
    plan = p.build()
    assert [op.req.id for op in plan.prefills] == ["big0"]


def test_a_prefix_hit_skips_cached_pages_but_always_computes_the_last_token():
    p = Planner(config(page_size=4))
    prompt = list(range(1, 17))
    p.submit(req("a", prompt, max_new=2))
    run_to_completion(p)
    p.submit(req("b", prompt + [99, 98], max_new=2))
    p.submit(req("c", prompt, max_new=2))
    plan = p.build()
    # b hits all 4 cached pages; c's hit is capped at 3 pages so its last token runs
    assert chunks(plan) == [("b", 16, 2), ("c", 12, 4)]


def test_batch_size_caps_the_round():
    p = Planner(config(max_batch_size=3))
    for i in range(5):
        p.submit(req(f"r{i}", 4))
    plan = p.build()
    assert len(plan.prefills) == 3


def test_each_request_is_scheduled_at_most_once_a_round():
    p = Planner(config(max_scheduled_tokens=64))
    for i in range(6):
        p.submit(req(f"r{i}", 10 + i, max_new=5))
    while p.has_work():
        plan, _ = step(p)
        ids = [op.req.id for op in plan.prefills] + [r.id for r in plan.decodes]
        assert len(ids) == len(set(ids))


def test_max_new_tokens_none_runs_to_the_context_limit():
    p = Planner(config(page_size=4, total_pages=16, max_context_tokens=40))
    r = req("a", 30, max_new=None)
    p.submit(r)
    run_to_completion(p)
    assert len(r.output) == 10 and r.finish_reason == "length"


def test_a_stop_reported_by_the_executor_finishes_the_request():
    p = Planner(config())
    r = req("a", 4, max_new=50)
    p.submit(r)
    step(p)
    plan = p.build()
    done = p.apply(plan, result_for(plan, stopped={r}))
    assert done == [r] and r.finish_reason == "stop"
    p.assert_idle()


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_in_any_state_releases_everything(when):
    p = Planner(config(max_scheduled_tokens=8))
    p.submit(req("a", 40 if when == "prefilling" else 4, max_new=50))
    if when != "waiting":
        step(p)
        step(p)
    p.abort("a")
    p.assert_idle()


def test_lifecycle_ends_with_no_page_held():
    p = Planner(config(page_size=4, total_pages=64, max_scheduled_tokens=16))
    for i in range(8):
        p.submit(req(f"r{i}", 3 + 5 * i, max_new=1 + i))
    done = run_to_completion(p)
    assert sorted(r.id for r in done) == [f"r{i}" for i in range(8)]
    assert all(len(r.output) == 1 + int(r.id[1:]) for r in done)
    p.assert_idle()


def test_same_submissions_give_the_same_plans():
    def trace():
        p = Planner(config(page_size=4, total_pages=48, max_scheduled_tokens=16))
        for i in range(10):
            p.submit(req(f"r{i}", [1, 2, 3, 4] * (i % 3 + 1) + [i], max_new=3 + i % 4))
        out = []
        while p.has_work():
            plan, _ = step(p)
            out.append((chunks(plan), [r.id for r in plan.decodes], list(plan.fresh_pages)))
        return out
    assert trace() == trace()


def test_state_collections_follow_the_fsm():
    p = Planner(config(max_scheduled_tokens=8))
    p.submit(req("a", 20, max_new=3))
    step(p)
    assert isinstance(p.requests["a"].state, Prefilling) and "a" in p.prefilling
    while not isinstance(p.requests["a"].state, Decoding):
        step(p)
    assert "a" in p.running


def test_a_stop_on_the_last_allowed_token_finishes_as_stop_not_length():
    """finish_reason is "stop" when the executor reports the token stopped
    the request, even when it was also the last one max_new allowed."""
    from support.planner import result_for

    p = Planner(config())
    a, b = req("a", 4, max_new=2), req("b", 4, max_new=2)
    p.submit(a)
    p.submit(b)
    plan = p.build()
    p.apply(plan, result_for(plan))
    plan = p.build()
    done = p.apply(plan, result_for(plan, stopped={a}))
    assert {r.id: r.finish_reason for r in done} == {"a": "stop", "b": "length"}
