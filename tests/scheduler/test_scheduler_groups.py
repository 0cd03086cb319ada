"""Cache groups (spec §1 reserves by retention, §1.3 bounded replay): a
sliding-window group beside full history, checked round by round."""

import pytest

from pdserve.scheduler import Planner
from pdserve.scheduler.cache.groups import FULL, HOLE, CacheGroupSpec
from pdserve.scheduler.capacity import group_pages, sliding_request_pages
from pdserve.scheduler.config import ConfigError
from pdserve.scheduler.round.grammar import Role

from support.planner import config, req, run_to_completion, step

W = 8          # window (tokens)
PS = 4         # page size


def sliding(window=W, replay=False):
    return CacheGroupSpec("sliding_window", window, replayable=replay)


def held(table):
    return [p for p in table if p != HOLE]


def planner(groups=(FULL, sliding()), role=Role.FUSED, **kw):
    base = dict(page_size=PS, total_pages=64, max_scheduled_tokens=16, sliding_pages=32)
    base.update(kw)
    return Planner(config(**base), role, groups=groups)


def test_a_long_prompt_holds_only_window_plus_chunk_on_the_sliding_group():
    p = planner()
    r = req("a", 100, max_new=40)
    p.submit(r)
    peak = 0
    while p.has_work():
        plan, _ = step(p)
        if r.state.holds_pages:
            full, slide = r.state.res.tables
            peak = max(peak, len(held(slide)))
            # the full history keeps every slot it has computed
            assert HOLE not in full
    # lookback of W - 1 = 7 rows plus a 16-token chunk and the decode slot:
    # ceil((7 + 16 + 1) / 4) + 1 = 7 pages, however long the prompt
    assert 0 < peak <= sliding_request_pages(p.cfg, W, 16) == 7
    p.assert_idle()


def test_decode_lets_go_of_pages_that_slid_out():
    p = planner(max_scheduled_tokens=64)
    r = req("a", 12, max_new=40)
    p.submit(r)
    sizes, firsts = [], []
    while r.state.__class__.__name__ != "Finished":
        step(p)
        if r.state.holds_pages:
            sizes.append(len(held(r.state.res.tables[1])))
            first = next(i for i, pg in enumerate(r.state.res.tables[1]) if pg != HOLE)
            # the next decode feeds position num_tokens - 1 and reads W back
            assert first <= max(r.num_tokens - W, 0) // PS
            firsts.append(first)
    # pages go back as a decode crosses into a new page: the window plus
    # the page being filled, never the history
    assert max(sizes) <= -(-(W + 1) // PS) + 1
    assert firsts[-1] >= (12 + 39 - W) // PS - 1
    assert len(r.output) == 40


def test_sliding_groups_reserve_no_headroom():
    """§1: a decoding role's first chunk raises the full-history reserve to
    the rest of the prompt plus headroom; sliding groups hold the decode slot."""
    p = planner(max_scheduled_tokens=8, safe_steps=32)
    r = req("a", 20, max_new=32)
    p.submit(r)
    step(p)
    full, slide = r.state.res.tables
    assert len(full) == -(-(20 + 32) // PS)             # whole prompt + headroom
    assert len(held(slide)) == 2                        # the first chunk of 8 tokens only


def test_admission_is_all_groups_or_nothing():
    # room on the full history, none on the sliding group: nothing changes
    p = planner(sliding_pages=sliding_request_pages(config(page_size=PS), W, 16))
    a, b = req("a", 40, max_new=30), req("b", 40, max_new=30)
    p.submit(a)
    step(p)
    free = [p.coord.available_pages(g) for g in (0, 1)]
    p.submit(b)
    plan, _ = step(p)
    assert b.state.__class__.__name__ == "Waiting"
    assert all(op.req is not b for op in plan.prefills)
    if not plan.prefills:
        assert [p.coord.available_pages(g) for g in (0, 1)] == free
    run_to_completion(p)
    p.assert_idle()


def test_a_prefix_hit_needs_the_lookback_on_every_sliding_group():
    p = planner()
    prompt = list(range(1, 41))
    p.submit(req("a", prompt, max_new=1))
    run_to_completion(p)
    b = req("b", prompt + [99] * 8, max_new=1)
    hit = p.coord.match(b, (len(b.prompt) - 1) // PS)
    # a's last window was cached when it finished: a hit at 40 tokens, with
    # the sliding group serving slots [first_live(40), 10)
    assert hit.pages == 10
    assert hit.first[1] == (40 - W + 1) // PS
    assert len(hit.device[1]) == 10 - hit.first[1]
    # pages of a's first chunks slid out and were evicted or never cached at
    # the hit's depth: evict the sliding group's cache and the hit goes
    grp = p.coord.groups[1]
    for pg in grp.index.evict(grp.index.num_idle):
        grp.pool.put_free(pg)
    assert p.coord.match(b, 11).pages < 10
    p.submit(b)
    run_to_completion(p)
    p.assert_idle()


def test_hits_are_identical_in_slots_to_a_cold_run():
    """The same prompt twice: the second admission claims cached pages for
    exactly the slots the first computed, in both groups."""
    p = planner()
    prompt = list(range(1, 33))
    p.submit(req("a", prompt, max_new=2))
    run_to_completion(p)
    b = req("b", prompt, max_new=2)
    p.submit(b)
    plan, _ = step(p)
    (op,) = plan.prefills
    assert op.begin == 28 and op.replay == 0            # the last page is recomputed
    run_to_completion(p)
    p.assert_idle()


def test_bounded_replay_refeeds_the_window_and_caches_nothing_of_the_group():
    p = planner(groups=(FULL, sliding(W, replay=True)), max_scheduled_tokens=32)
    prompt = list(range(1, 41))
    p.submit(req("a", prompt, max_new=1))
    run_to_completion(p)
    assert p.coord.groups[1].index.num_cached == 0      # never published (§1.3)
    b = req("b", prompt + list(range(50, 70)), max_new=3)
    p.submit(b)
    plan, _ = step(p)
    (op,) = plan.prefills
    assert op.begin == 40 and op.replay == W            # re-feeds [32, 40)
    # the replayed group's table starts at the first re-fed row's page: it
    # holds nothing this forward does not write
    slide = b.state.res.tables[1]
    assert held(slide) and slide.index(held(slide)[0]) == (40 - W) // PS
    run_to_completion(p)
    assert p.coord.groups[1].index.num_cached == 0
    p.assert_idle()


def test_no_final_chunk_is_shorter_than_the_replay_window():
    p = planner(groups=(FULL, sliding(W, replay=True)), max_scheduled_tokens=16)
    r = req("a", 36, max_new=1)
    p.submit(r)
    chunks = []
    while p.has_work():
        plan, _ = step(p)
        chunks += [op.tokens for op in plan.prefills]
    # 16 + 12 would leave 8 = W exactly; 16 + 16 would leave 4 < W
    assert chunks[-1] >= W and sum(chunks) == 36


def test_replay_needs_a_budget_that_still_advances():
    with pytest.raises(ConfigError, match="max_scheduled_tokens"):
        planner(groups=(FULL, sliding(W, replay=True)), max_scheduled_tokens=12)


def test_replay_is_all_or_nothing():
    with pytest.raises(ConfigError, match="all or nothing"):
        planner(groups=(FULL, sliding(W, replay=True), sliding(W + 4)))


def test_a_sliding_pool_too_small_for_one_request_is_refused_at_start():
    with pytest.raises(ConfigError, match="sliding_pages"):
        planner(sliding_pages=3)


def test_default_sliding_pool_is_sized_for_the_batch_not_the_context():
    cfg = config(page_size=16, total_pages=100_000, max_scheduled_tokens=2048,
                 max_batch_size=64)
    full, slide = group_pages(cfg, [FULL, sliding(1024)])
    assert full == 100_000
    assert slide == 64 * sliding_request_pages(cfg, 1024, 1) + 2048 // 16


def test_sliding_groups_let_more_long_requests_run_at_once():
    """The point of the groups: with the same pages per group, requests that
    keep a window fit where full retention of every layer would not."""
    long = 64

    def concurrent(groups):
        p = planner(groups=groups, total_pages=40, sliding_pages=40, max_scheduled_tokens=64)
        for i in range(6):
            p.submit(req(f"r{i}", long, max_new=4))
        most = 0
        while p.has_work():
            step(p)
            most = max(most, len(p.running))
        p.assert_idle()
        return most

    # one full-history group of 40 pages holds two 64-token requests; the
    # sliding layers of a 5:1 model would need the same again per layer set
    assert concurrent((FULL, sliding())) == concurrent((FULL,))
    assert concurrent((sliding(),)) > concurrent((FULL,))


def test_retraction_with_host_snapshots_restores_every_group():
    p = planner(total_pages=12, sliding_pages=14, host_pages=64, safe_steps=2,
                max_scheduled_tokens=16)
    for i in range(3):
        p.submit(req(f"r{i}", 10, max_new=24))
    run_to_completion(p)
    p.assert_idle()


def test_pd_moves_only_the_last_window_of_a_sliding_group():
    from support.pd import PDPair

    cfg = config(page_size=PS, total_pages=64, sliding_pages=32, max_scheduled_tokens=16)
    pair = PDPair(cfg, cfg, groups=[FULL, sliding()])
    r = req("a", 50, max_new=3)
    pair.submit(r)
    dplan, _ = pair.tick()
    (op,) = dplan.remote_prefills
    full, slide = op.landing
    assert len(full) == -(-50 // PS)
    # D's first decode reads positions [43, 50]: slots 10..12
    assert len(slide) == -(-50 // PS) - (50 - W + 1) // PS
    pair.run()
    assert len(r.output) == 3
    pair.D.assert_idle()
    pair.P.assert_idle()
