"""The planner's side of speculative decoding (scheduler/speculation.py):
candidates come in a round's result, the next decode carries them as a
verify row, and pages, budget and publication follow the verified frontier."""

from __future__ import annotations

import random

import pytest

from pdserve.scheduler import Planner, StepResult
from pdserve.scheduler.round.grammar import Role

from support.planner import config, req, result_for

K = 3
SPEC = {"num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def spec_config(**kw):
    return config(speculative=SPEC, **kw)


def verify_result(plan, accept, drafts_next, token=1) -> StepResult:
    """What an executor reports: each verify accepting `accept(req, drafts)`
    of its candidates (then one more token), every request proposing
    `drafts_next(req)` for its next step."""
    res = result_for(plan, token)
    for i, req in enumerate(plan.decodes):
        carried = plan.verify.get(req.id, [])
        if carried:
            got = list(carried[:accept(req, carried)]) + [token]
            res.decode_tokens[i] = got[0]
            if len(got) > 1:
                res.decode_more[req.id] = got[1:]
    sampled = [op.req for op in plan.prefills if op.completes] + list(plan.decodes)
    res.drafts = {r.id: d for r in sampled if (d := drafts_next(r))}
    return res


def test_the_completing_chunk_reserves_one_plus_k_on_every_role():
    for role in Role:
        p = Planner(spec_config(), role)
        assert p.cfg.decode_input_tokens == 1 + K
        r = req("a", 8)
        if role is Role.DECODE:
            continue                     # D's landing reserves it (remote admission)
        p.submit(r)
        p.build()
        # the prompt's 8 tokens and a verify row of 1 + k behind its last one
        assert r.capacity >= 8 + 1 + K - 1


def test_a_verify_row_counts_its_candidates_against_the_budget():
    p = Planner(spec_config(max_scheduled_tokens=10), Role.FUSED)
    for i in range(4):
        p.submit(req(f"r{i}", 4, max_new=20))
    plan = p.build()
    p.apply(plan, verify_result(plan, lambda r, d: 0, lambda r: [7, 7, 7]))
    plan = p.build()
    spent = len(plan.decodes) + sum(len(v) for v in plan.verify.values()) + \
        sum(op.tokens + op.replay for op in plan.prefills)
    assert plan.verify and spent <= 10
    # the first request's row is whole; later ones are cut to the budget left
    assert len(plan.verify["r0"]) == K
    p.apply(plan, verify_result(plan, lambda r, d: len(d), lambda r: []))
    p.check_invariants()


def test_accepted_tokens_land_in_order_and_never_past_max_tokens():
    p = Planner(spec_config(), Role.FUSED)
    r = req("a", 6, max_new=4)
    p.submit(r)
    plan = p.build()
    p.apply(plan, verify_result(plan, lambda r, d: 0, lambda r: [5, 6, 7]))
    plan = p.build()
    # 1 token out, 3 left: a verify of at most 2 candidates and one more
    assert plan.verify["a"] == [5, 6]
    done = p.apply(plan, verify_result(plan, lambda r, d: len(d), lambda r: [1]))
    assert r.output == [1, 5, 6, 1] and done == [r]
    p.assert_idle()


def test_a_rejected_tail_is_never_published_to_the_prefix_index():
    """The verify feeds position 5 (the first token) and 6 (a candidate, 9)
    and accepts nothing: the frontier stays at position 6, page 1 (4..7)
    is not full of computed tokens, and nothing of the candidate is
    published, while finishing publishes every page the accepted tokens
    fill."""
    p = Planner(spec_config(page_size=4), Role.FUSED)
    r = req("a", 5, max_new=3)
    p.submit(r)
    plan = p.build()
    p.apply(plan, verify_result(plan, lambda r, d: 0, lambda r: [9, 9, 9]))
    plan = p.build()
    assert plan.verify["a"] == [9]            # 2 tokens left: one candidate and one more
    p.apply(plan, verify_result(plan, lambda r, d: 0, lambda r: [], token=2))
    assert r.output == [1, 2]
    assert p.cached_pages(req("b", r.prompt.tokens + [1, 9, 9], max_new=1)) == 1
    plan = p.build()
    p.apply(plan, verify_result(plan, lambda r, d: 0, lambda r: [], token=3))
    p.assert_idle()
    assert p.cached_pages(req("c", r.prompt.tokens + [1, 2, 3, 4], max_new=1)) == 1
    assert p.cached_pages(req("d", r.prompt.tokens + [1, 9, 3, 4], max_new=1)) == 1


def test_abort_after_a_verify_and_with_candidates_pending_releases_everything():
    p = Planner(spec_config(), Role.FUSED)
    for i in range(3):
        p.submit(req(f"r{i}", 9, max_new=30))
    for _ in range(3):
        plan = p.build()
        p.apply(plan, verify_result(plan, lambda r, d: 1, lambda r: [4, 4, 4]))
    assert all(r.drafts for r in p.running.values())
    for rid in list(p.requests):
        p.abort(rid)
    p.assert_idle()


@pytest.mark.parametrize("seed", range(6))
def test_random_verifies_under_retraction_keep_every_invariant(seed):
    """Random candidates, random acceptance, a pool too small for everyone:
    retraction, readmission and verify rows together keep the invariants,
    and every request ends with exactly its max_new tokens."""
    rng = random.Random(seed)
    p = Planner(spec_config(page_size=4, total_pages=14, safe_steps=2,
                            max_scheduled_tokens=16, host_pages=32 * (seed % 2)), Role.FUSED)
    reqs = [req(f"r{i}", rng.randint(1, 14), max_new=rng.randint(1, 25)) for i in range(10)]
    verifies = 0
    for r in reqs:
        p.submit(r)
    for _ in range(2000):
        if not p.has_work():
            break
        plan = p.build()
        assert not plan.is_empty()
        for r in plan.decodes:            # a verify row fits the pages it was given
            assert r.num_tokens + len(plan.verify.get(r.id, [])) <= r.capacity
        verifies += len(plan.verify)
        p.apply(plan, verify_result(plan, lambda r, d: rng.randint(0, len(d)),
                                    lambda r: [rng.randint(1, 9) for _ in
                                               range(rng.randint(0, K))]))
        p.check_invariants()
    p.assert_idle()
    assert all(len(r.output) == r.max_new_tokens for r in reqs)
    assert verifies > 20 and sum(r.retractions for r in reqs) > 0
