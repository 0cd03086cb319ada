"""Property test (spec §5): random workloads through the fused planner,
invariants checked after every round, every request ends, nothing leaks.
Each workload draws its cache groups too: full history alone, beside a
sliding window (cached or replayed, §1.3), sliding windows alone, or full
history beside a snapshot-state group (§1.2) with or without a window."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler import Planner
from pdserve.scheduler.cache_groups import FULL, CacheGroupSpec, replay_window
from pdserve.scheduler.capacity import sliding_request_pages
from pdserve.scheduler.fsm import Prefilling

from support import config, req, result_for

PREFIXES = [[7] * 12, [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3]]


def sliding(window, replay=False):
    return CacheGroupSpec("sliding_window", window, replayable=replay)


def state(block):
    return CacheGroupSpec("snapshot_state", block=block)


@st.composite
def cache_groups(draw, page: int, budget: int):
    """(groups, budget, sliding_pages, state_slots): a group set, the chunk
    budget raised to what bounded replay or a state block needs, a sliding
    pool from one request's working set up (tight) to roomy, and a state
    pool from one request's slots up (0: the default)."""
    w = draw(st.integers(1, 3 * page + 2))
    block = page * draw(st.integers(1, 3))
    groups = draw(st.sampled_from([
        (FULL,), (FULL,), (FULL, sliding(w)), (FULL, sliding(w, True)),
        (FULL, sliding(w), sliding(w + page)), (sliding(w),), (sliding(w, True),),
        (FULL, state(block)), (FULL, state(block)), (FULL, sliding(w), state(block))]))
    r = replay_window(groups)
    if r:
        budget = max(budget, -(-r // page) * page + max(r, page))
    if any(g.state for g in groups):
        budget = max(budget, block)
    need = max((sliding_request_pages(config(page_size=page), g.window, budget)
                for g in groups if g.sliding), default=0)
    slots = draw(st.sampled_from([0, 4, 5, 8]))
    return groups, budget, need + draw(st.integers(0, 2 * need + 1)), slots


@st.composite
def workloads(draw):
    page = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 14))
    reqs = []
    for i in range(n):
        prefix = draw(st.sampled_from([[]] + PREFIXES))
        tail = draw(st.lists(st.integers(1, 50), min_size=0 if prefix else 1, max_size=30))
        max_new = draw(st.integers(1, 24))
        arrive = draw(st.integers(0, 12))
        stop_at = draw(st.one_of(st.none(), st.integers(1, 24)))
        reqs.append((f"r{i}", prefix + tail, max_new, arrive, stop_at))
    biggest = max(-(-(len(p) + m) // page) for _, p, m, _, _ in reqs)
    pages = biggest + draw(st.integers(0, 3 * biggest))
    groups, budget, swp, slots = draw(cache_groups(page, max(page, draw(st.integers(1, 64)))))
    cfg = config(page_size=page, total_pages=pages, sliding_pages=swp, state_slots=slots,
                 max_scheduled_tokens=budget,
                 max_batch_size=draw(st.integers(1, 8)),
                 enable_mixed_prefill_decode=draw(st.booleans()))
    abort = draw(st.one_of(st.none(), st.tuples(st.integers(0, n - 1), st.integers(0, 30))))
    return cfg, reqs, abort, groups


@settings()
@given(workloads())
def test_random_fused_workloads_end_with_every_request_done_and_nothing_held(w):
    cfg, reqs, abort, groups = w
    p = Planner(cfg, groups=groups)
    pending = sorted(reqs, key=lambda r: r[3])
    stop_at = {rid: s for rid, _, _, _, s in reqs}
    live = {}
    ended = set()
    for rnd in range(5000):
        while pending and pending[0][3] <= rnd:
            rid, prompt, max_new, _, _ = pending.pop(0)
            r = req(rid, prompt, max_new=max_new)
            p.submit(r)
            live[rid] = r
        if abort and abort[1] == rnd and f"r{abort[0]}" in p.requests:
            p.abort(f"r{abort[0]}")
            ended.add(f"r{abort[0]}")
        if not p.has_work() and not pending:
            break
        plan = p.build()
        if p.has_work():
            assert not plan.is_empty(), "a round built nothing while requests wait"
        prefills = plan.prefills
        assert all(op.completes for op in prefills[:-1]), "only the last chunk may be truncated"
        if prefills and not prefills[-1].completes:
            assert isinstance(prefills[-1].req.state, Prefilling)
        stopped = {r for r in plan.decodes if stop_at[r.id] == len(r.output) + 1}
        for op in prefills:
            if op.completes and stop_at[op.req.id] == len(op.req.output) + 1:
                stopped.add(op.req)
        for r in p.apply(plan, result_for(plan, stopped=stopped)):
            ended.add(r.id)
            assert len(r.output) <= r.max_new_tokens
        p.check_invariants()
    assert ended == set(live), "some request never ended"
    p.assert_idle()


@st.composite
def tight_workloads(draw):
    page = draw(st.sampled_from([2, 4]))
    safe = draw(st.sampled_from([2, 4, 8, 16]))
    n = draw(st.integers(1, 10))
    reqs = []
    for i in range(n):
        prefix = draw(st.sampled_from([[]] + PREFIXES))
        tail = draw(st.lists(st.integers(1, 50), min_size=0 if prefix else 1, max_size=16))
        max_new = draw(st.integers(1, 40))
        arrive = draw(st.integers(0, 20))
        strict = draw(st.booleans()) and draw(st.booleans())
        reqs.append((f"r{i}", prefix + tail, max_new, arrive, strict))
    biggest = max(-(-(len(p) + m) // page) for _, p, m, _, _ in reqs)
    pages = biggest + draw(st.integers(0, biggest))
    host = draw(st.sampled_from([0, 0, 4 * biggest, biggest // 2 + 1]))
    groups, budget, swp, slots = draw(cache_groups(page, max(page, draw(st.integers(1, 48)))))
    cfg = config(page_size=page, total_pages=pages, safe_steps=safe, host_pages=host,
                 state_slots=slots,
                 max_scheduled_tokens=budget, sliding_pages=swp,
                 max_batch_size=draw(st.integers(1, 8)),
                 enable_mixed_prefill_decode=draw(st.booleans()))
    return cfg, reqs, groups


@settings()
@given(tight_workloads())
def test_tight_pools_with_retraction_finish_everything_within_the_retraction_bound(w):
    cfg, reqs, groups = w
    p = Planner(cfg, groups=groups)
    pending = sorted(reqs, key=lambda r: r[3])
    live = {}
    for rnd in range(20000):
        while pending and pending[0][3] <= rnd:
            rid, prompt, max_new, _, strict = pending.pop(0)
            live[rid] = req(rid, prompt, max_new=max_new, strict=strict)
            p.submit(live[rid])
        if not p.has_work() and not pending:
            break
        plan = p.build()
        if p.has_work():
            assert not plan.is_empty(), "a round built nothing while requests wait"
        p.apply(plan, result_for(plan))
        p.check_invariants()
    else:
        raise AssertionError("did not finish")
    assert p.stalls == []
    for r in live.values():
        assert len(r.output) == r.max_new_tokens, r
        if r.max_new_tokens <= cfg.safe_steps or r.limits.strict:
            assert r.retractions == 0, r
        assert r.retractions <= -(-r.max_new_tokens // cfg.safe_steps), r
    p.assert_idle()


@st.composite
def pd_workloads(draw):
    page = draw(st.sampled_from([2, 4]))
    n = draw(st.integers(1, 10))
    reqs = []
    for i in range(n):
        prefix = draw(st.sampled_from([[]] + PREFIXES))
        tail = draw(st.lists(st.integers(1, 50), min_size=0 if prefix else 1, max_size=20))
        reqs.append((f"r{i}", prefix + tail, draw(st.integers(1, 30)), draw(st.integers(0, 15)),
                     draw(st.sampled_from(["ok", "ok", "ok", "fail", "lose_ack", "abort"]))))
    biggest = max(-(-(len(p) + m) // page) for _, p, m, _, _ in reqs)
    groups, budget, swp, slots = draw(cache_groups(page, max(page, draw(st.integers(1, 48)))))
    d_cfg = config(page_size=page, total_pages=biggest + draw(st.integers(0, 2 * biggest)),
                   safe_steps=draw(st.sampled_from([2, 8, 4096])), sliding_pages=swp,
                   state_slots=slots,
                   host_pages=draw(st.sampled_from([0, 2 * biggest])),
                   max_scheduled_tokens=budget, max_batch_size=draw(st.integers(1, 8)))
    p_cfg = config(page_size=page, total_pages=biggest + draw(st.integers(0, 2 * biggest)),
                   max_scheduled_tokens=budget, sliding_pages=swp, state_slots=slots)
    return p_cfg, d_cfg, reqs, groups


@settings()
@given(pd_workloads())
def test_random_pd_workloads_with_failures_end_every_request_and_leak_nothing(w):
    from pd_support import PDPair

    p_cfg, d_cfg, reqs, groups = w
    pair = PDPair(p_cfg, d_cfg, groups=groups)
    pending = sorted(reqs, key=lambda r: r[3])
    live, aborted = {}, set()
    for rnd in range(20000):
        while pending and pending[0][3] <= rnd:
            rid, prompt, max_new, _, fate = pending.pop(0)
            live[rid] = req(rid, prompt, max_new=max_new)
            pair.submit(live[rid])
            if fate == "fail":
                pair.fail_next.add(rid)
            elif fate == "lose_ack":
                pair.lose_ack.add(rid)
            elif fate == "abort":
                aborted.add(rid)
        for rid in list(aborted):
            if rid in pair.D.requests and rnd % 3 == 0:
                pair.D.abort(rid)
                if rid in pair.P.requests:
                    pair.P.peer_ack(rid)           # the abort reaches P
                aborted.discard(rid)
        if not (pending or pair.D.has_work() or pair.P.has_work() or pair.in_flight):
            break
        dplan, pplan = pair.tick()
        if not pending:
            assert not (dplan.is_empty() and pplan.is_empty()), "both sides stalled"
    else:
        raise AssertionError("did not finish")
    for r in live.values():
        assert r.finish_reason in ("length", "abort"), r
        if r.finish_reason == "length":
            assert len(r.output) == r.max_new_tokens
    pair.D.assert_idle()
    pair.P.assert_idle()
