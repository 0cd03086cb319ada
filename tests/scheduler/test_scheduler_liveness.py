"""Liveness (issue 34): workloads whose pool holds the working set finish,
and the last resort (`Planner.stalls`) never runs for them. One rule a test;
each runs its workload to completion with the invariants checked every round
and ends idle."""

import pytest

from pdserve.scheduler import Planner, RejectedRequest
from pdserve.scheduler.cache.groups import FULL, CacheGroupSpec
from pdserve.scheduler.round.prefill import resume_point
from pdserve.scheduler.round.waiting import Hold

from support.planner import config, req, result_for


def drive(p: Planner, arrivals=(), max_rounds: int = 500) -> list:
    """Run `p`, submitting each (round, request) of `arrivals` at its round,
    until nothing is live; check the invariants every round and that it
    ends idle. Returns the plans."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    plans = []
    for rnd in range(max_rounds):
        while arrivals and arrivals[0][0] <= rnd:
            p.submit(arrivals.pop(0)[1])
        if not arrivals and not p.has_work():
            p.assert_idle()
            return plans
        plan = p.build()
        plans.append(plan)
        p.apply(plan, result_for(plan))
        p.check_invariants()
    raise AssertionError(f"did not finish in {max_rounds} rounds: {p.requests}, "
                         f"stalls {p.stalls[:2]}")


def victims(plans) -> list[str]:
    return [r.req.id for plan in plans for r in plan.retracts]


# ---- §1.4: the bound covers a requeued victim's history ------------------------

def _eleven_one_token_pages(**kw) -> Planner:
    # fused, no host tier: a victim re-prefills its prompt plus its output
    return Planner(config(page_size=1, total_pages=11, decode_input_tokens=2, safe_steps=2,
                          max_scheduled_tokens=4, max_batch_size=2, **kw))


def test_a_requeued_victim_fits_its_readmission():
    """A victim retracted before its last decode re-prefills prompt plus
    all but its last token, and the chunk completing that history reserves
    the decode slot: prompt + max_new_tokens - 1 + decode_input_tokens must
    fit the pool, or it never fits again and the FIFO behind it waits.
    Ingest refuses a request beyond that, naming the fix; an undeclared
    max_new_tokens is capped to it."""
    p = _eleven_one_token_pages()
    with pytest.raises(RejectedRequest) as e:
        p.submit(req("over", [1] * 4, max_new=7))
    msg = str(e.value)
    assert "lower max_new_tokens to at most 6" in msg and "decode_input_tokens=2" in msg
    assert "raise engine.total_pages" in msg and not p.requests

    # the three histories match page for page, so "a" grows beside the
    # others' shared pages; blocked, it is the victim one token before its
    # end, and its re-prefill (9 tokens and the slot of 2) takes the pool
    a = req("a", [1] * 2, max_new=None)
    arrivals = [(1, a), (6, req("b", [1] * 3, max_new=None)),
                (7, req("c", [1] * 3, max_new=None))]
    assert victims(drive(p, arrivals)) == ["a"]
    assert a.max_new_tokens == 8 == len(a.output) and a.finish_reason == "length"
    assert p.stalls == []


def test_a_first_chunk_reserves_the_slot_its_completing_chunk_needs():
    """A decoding role's first chunk holds the rest of the prompt plus at
    least the decode slot: a headroom of one token under a slot of two
    would let the completing chunk fail for want of a page it never held."""
    p = _eleven_one_token_pages()
    r = req("r", 6, max_new=1)
    p.submit(r)
    plan = p.build()
    assert plan.prefills[0].tokens == 4 and not plan.prefills[0].completes
    assert len(r.state.res.tables[0]) == 6 + 2
    p.apply(plan, result_for(plan))
    drive(p)
    assert p.stalls == []


# ---- §1.3: a readmission's replay fits the budget -----------------------------

def test_a_readmission_resumes_on_a_page_boundary_so_its_replay_fits_the_budget():
    """Window 4, budget 8: the final-window rule cuts a 9-token prompt at 5,
    mid-page. Resuming there would re-feed 5 rows and still owe the window
    of 4 new tokens: 9 rows, over the budget, every round. A readmission
    resumes on the page boundary at or below what it computed (4 replayed
    rows, then 1 and 4 new tokens), which is what `min_prefill_tokens`
    sized the budget for; a victim with only its sampled token left
    resumes where it is."""
    assert resume_point(5, 9, 4) == 4
    assert resume_point(13, 18, 4) == 12
    assert resume_point(8, 9, 4) == 8
    # in a planner: r0 is retracted mid-page (13 tokens computed, a decode
    # that ran into the full-history pool) and readmits at 12, replaying 4
    p = Planner(config(page_size=4, total_pages=6, host_pages=64, max_scheduled_tokens=8,
                       max_batch_size=2, safe_steps=2, sliding_pages=7,
                       enable_mixed_prefill_decode=False),
                groups=(FULL, CacheGroupSpec("sliding_window", 4, replayable=True)))
    r0 = req("r0", 9, max_new=9)
    plans = drive(p, [(0, req("r1", 9, max_new=8)), (2, r0)])
    cut = [op.begin + op.tokens for plan in plans for op in plan.prefills
           if op.req is r0 and not op.completes]
    resumed = [(op.begin, op.replay) for plan in plans for op in plan.prefills
               if op.req is r0 and op.replay]
    assert 5 in cut and "r0" in victims(plans)
    assert resumed == [(12, 4)]
    assert len(r0.output) == 9
    assert p.stalls == []


def test_a_sliding_pool_admits_no_newcomer_its_residents_may_still_grow_into():
    """The deep property search's finding: a sliding-only pool of 5 pages
    (window 10, page 4, chunk 4). r0 decodes holding 3 pages and will need
    a 4th; r1 (max_new_tokens=1, so its admission prepaid its generation
    and it is exempt from retraction) took the last two in chunks. Neither
    could advance, nobody could be retracted, and the last resort ran.
    Now r1 waits until r0 has room to grow: no victim, no stall."""
    p = Planner(config(page_size=4, total_pages=4, host_pages=0, max_scheduled_tokens=4,
                       max_batch_size=1, safe_steps=2, sliding_pages=5,
                       enable_mixed_prefill_decode=False),
                groups=(CacheGroupSpec("sliding_window", 10),))
    arrivals = [(0, req("r0", list(range(1, 9)), max_new=6, strict=True))]
    arrivals += [(0, req(f"r{i}", [7] * 12, max_new=1)) for i in (1, 2, 3)]
    plans = drive(p, arrivals)
    assert victims(plans) == [] and p.stalls == []
    assert [len(r.output) for _, r in arrivals] == [6, 1, 1, 1]


def test_a_newcomer_waits_for_sliding_room_with_its_reason():
    """The same pool, one round in: r1 is first in line, and its wait names
    the sliding pool's residents, not a failed admission (no retraction)."""
    p = Planner(config(page_size=4, total_pages=4, host_pages=0, max_scheduled_tokens=4,
                       max_batch_size=1, safe_steps=2, sliding_pages=5,
                       enable_mixed_prefill_decode=False),
                groups=(CacheGroupSpec("sliding_window", 10),))
    p.submit(req("r0", list(range(1, 9)), max_new=6, strict=True))
    p.submit(req("r1", [7] * 12, max_new=1))
    for _ in range(2):                           # r0's two chunks
        plan = p.build()
        p.apply(plan, result_for(plan))
    plan = p.build()
    assert [d.id for d in plan.decodes] == ["r0"] and not plan.retracts
    why = {w.req_id: w for w in p.waiting_reasons()}["r1"]
    assert why.reason == Hold.SLIDING_ROOM and why.blocked_by is None
    assert "sliding-window pool" in why.detail and why.pages_needed > why.pages_free


# ---- §2: a victim does not come straight back -----------------------------------

@pytest.mark.parametrize("host", [64, 0])
def test_a_victim_is_not_readmitted_ahead_of_the_request_it_was_retracted_for(host):
    """A sliding-only group (window 5) of 11 pages, three requests whose
    working sets are 8 pages each. A victim yields to the request its pages
    were freed for until that one is served (admitted past its prompt, a
    step further, or gone); readmitting it first hands it the pages
    straight back, and the two swap every round (the loop §2 names) until
    the last resort retracts and readmits one forever. With a host tier the
    victim readmits; without one it re-queues, and either way it waits."""
    p = Planner(config(page_size=1, total_pages=64, sliding_pages=11, host_pages=host,
                       max_scheduled_tokens=2, max_batch_size=3, safe_steps=1,
                       enable_mixed_prefill_decode=False),
                groups=(CacheGroupSpec("sliding_window", 5),))
    reqs = [req("r0", [1] * 7, max_new=6), req("r1", [1] * 7, max_new=5), req("r2", 8, max_new=1)]
    plans = drive(p, [(0, reqs[0]), (2, reqs[1]), (3, reqs[2])])
    assert all(len(r.output) == r.limits.max_new_tokens for r in reqs)
    for plan in plans:                  # never back in the round it left
        assert not {r.req.id for r in plan.retracts} & {r.id for r in plan.readmits}
    assert len(victims(plans)) <= 2
    assert p.stalls == []
