"""The disk (L3) tier as the planner sees it (spec §1, §4): a request
carries what the engine's probe found (`disk_pages`, `disk_wait`), and
admission reads those pages disk -> host -> device in the round, shortened
to what the host tier can stage and rounded down to the prefix
granularity; a read that misses retracts the request, publishing nothing
of it, and it re-prefills."""

from pdserve.scheduler import Planner
from pdserve.scheduler.plan import StepResult
from pdserve.scheduler.cache.prefix import ROOT_HASH, chain_hash
from pdserve.scheduler.round.waiting import Hold

from support.planner import config, req, result_for, run_to_completion, step


def planner(**kw) -> Planner:
    base = dict(page_size=4, total_pages=64, host_pages=32, max_scheduled_tokens=64)
    base.update(kw)
    return Planner(config(**base))


def chains(prompt, pages: int, ps: int = 4) -> list[int]:
    h, out = ROOT_HASH, []
    for i in range(pages):
        h = chain_hash(h, tuple(prompt[i * ps:(i + 1) * ps]))
        out.append(h)
    return out


PROMPT = list(range(1, 34))          # 33 tokens: 8 full pages before the last token


def test_a_disk_hit_is_read_through_host_and_skipped_by_the_forward():
    p = planner()
    r = req("a", PROMPT)
    r.disk_pages = 5
    p.submit(r)
    plan = p.build()
    (dl,) = plan.disk_loads
    assert dl.chains == chains(PROMPT, 5) and dl.first_page == 0
    (ld,) = plan.loads
    assert ld.host_pages == dl.host_pages          # the load copies what the read fills
    assert ld.device_pages == r.state.res.tables[0][:5]
    (op,) = plan.prefills
    assert op.begin == 20 and r.cached == (0, 0, 20)
    p.check_invariants()
    p.apply(plan, result_for(plan))
    p.check_invariants()
    run_to_completion(p)
    p.assert_idle()
    assert p.hits.disk_tokens == 20 and p.hits.disk_missed == 0


def test_a_disk_hit_is_not_published_before_its_read_is_confirmed():
    """An incomplete first chunk: the next chunk's admission may publish
    the disk pages only once the read hit."""
    p = planner(max_scheduled_tokens=8)
    r = req("a", PROMPT)
    r.disk_pages = 5
    p.submit(r)
    plan = p.build()
    assert plan.disk_loads and not plan.prefills[0].completes
    # while unconfirmed, nobody else can hit those pages on the device
    assert p.coord.match(req("b", PROMPT), 8).pages == 0
    p.apply(plan, result_for(plan))
    p.build()
    assert p.coord.match(req("b", PROMPT), 8).pages >= 5


def test_a_miss_after_admission_retracts_and_re_prefills_without_publishing():
    p = planner()
    r = req("a", PROMPT)
    r.disk_pages = 5
    p.submit(r)
    plan = p.build()
    (dl,) = plan.disk_loads
    res = StepResult([], [7], set(), [], [ld.id for ld in plan.loads], [], [dl.id])
    assert p.apply(plan, res) == []
    p.check_invariants()
    assert r.output == [] and r.disk_pages == 0 and r.retractions == 1
    assert p.waiting[0] is r
    # nothing of the empty pages was published
    assert p.coord.match(req("b", PROMPT), 8).pages == 0
    plan = p.build()
    assert not plan.disk_loads and plan.prefills[0].begin == 0
    p.apply(plan, result_for(plan))
    run_to_completion(p)
    p.assert_idle()
    assert p.hits.disk_missed == 1


def test_a_disk_hit_is_shortened_to_the_host_pages_that_can_stage_it():
    """Spec §1: a prefetch that cannot allocate every probed page is
    shortened; the rest is computed."""
    p = planner(host_pages=3)
    r = req("a", PROMPT)
    r.disk_pages = 8
    p.submit(r)
    plan = p.build()
    (dl,) = plan.disk_loads
    assert len(dl.chains) == 3 and plan.prefills[0].begin == 12
    p.apply(plan, result_for(plan))
    run_to_completion(p)
    p.assert_idle()


def test_a_disk_hit_continues_a_device_hit():
    p = planner()
    first = req("a", PROMPT[:13])
    p.submit(first)
    run_to_completion(p)                  # pages 0..2 cached on the device
    r = req("b", PROMPT)
    r.disk_pages = 6
    p.submit(r)
    plan = p.build()
    (dl,) = plan.disk_loads
    assert dl.first_page == 3 and dl.chains == chains(PROMPT, 6)[3:]
    assert r.cached == (12, 0, 12)
    p.apply(plan, result_for(plan))
    run_to_completion(p)
    p.assert_idle()


def test_a_prefetch_in_progress_holds_the_line():
    p = planner()
    r = req("a", PROMPT)
    r.disk_wait = True
    p.submit(r)
    p.submit(req("b", 8))
    plan = p.build()
    assert plan.is_empty()
    why = {w.req_id: w.reason for w in p.waiting_reasons()}
    assert why == {"a": Hold.DISK_PREFETCH, "b": Hold.DISK_PREFETCH}
    r.disk_wait = False
    plan, _ = step(p)
    assert [op.req.id for op in plan.prefills] == ["a", "b"]
    run_to_completion(p)
    p.assert_idle()


def test_a_state_models_disk_hit_ends_at_the_checkpoint_the_probe_found():
    """A state group (§1.2): the disk hit reads its pages and the state
    checkpoint at its end (a second DiskLoadOp, into a host slot, loaded
    into the slot the forward reads); a hit the host room or the prefix
    granularity would cut below the probe's checkpoint reads nothing."""
    from pdserve.scheduler.cache.groups import FULL, CacheGroupSpec

    def state_planner():
        return Planner(config(page_size=4, total_pages=64, host_pages=32, state_slots=16),
                       groups=(FULL, CacheGroupSpec("snapshot_state", block=8)))
    p = state_planner()
    r = req("a", PROMPT)
    r.disk_pages = 5                      # 20 tokens: no checkpoint (blocks of 8)
    p.submit(r)
    plan = p.build()
    assert not plan.disk_loads and plan.prefills[0].begin == 0
    p = state_planner()
    r = req("b", PROMPT)
    r.disk_pages = 4                      # 16 tokens: a checkpoint
    p.submit(r)
    plan = p.build()
    pages, state = plan.disk_loads
    assert pages.chains == chains(PROMPT, 4) and pages.group == 0
    assert state.chains == chains(PROMPT, 4)[-1:] and state.group == 1
    (ld,) = [ld for ld in plan.loads if ld.group == 1]
    assert ld.host_pages == state.host_pages
    assert ld.device_pages == [r.state.res.tables[1][3]]
    assert plan.prefills[0].begin == 16 and r.cached == (0, 0, 16)
    p.check_invariants()
    p.apply(plan, result_for(plan))
    run_to_completion(p)
    p.assert_idle()
    assert p.hits.disk_tokens == 16


def test_a_disk_hit_beside_replayable_windows_replays_them_from_the_disk_pages():
    """Bounded replay (§1.3): the disk serves the full-history pages, and
    the first chunk after the hit re-feeds the window's rows below it;
    a cached (non-replayable) window reads nothing from disk."""
    from pdserve.scheduler.cache.groups import FULL, CacheGroupSpec
    for replay in (True, False):
        p = Planner(config(page_size=4, total_pages=64, host_pages=32, sliding_pages=32,
                           max_scheduled_tokens=64, sliding_replay=replay),
                    groups=(FULL, CacheGroupSpec("sliding_window", 4, replayable=replay)))
        assert p.coord.serves_disk is replay and p.coord.landing_serves_disk is replay
        r = req("a", PROMPT)
        r.disk_pages = 5
        p.submit(r)
        plan = p.build()
        if not replay:
            assert not plan.disk_loads and plan.prefills[0].begin == 0
            continue
        (dl,) = plan.disk_loads
        assert dl.chains == chains(PROMPT, 5)
        (op,) = plan.prefills
        assert op.begin == 20 and op.replay > 0 and r.cached == (0, 0, 20)
        p.check_invariants()
        p.apply(plan, result_for(plan))
        run_to_completion(p)
        p.assert_idle()
        assert p.hits.disk_tokens == 20


def test_a_disk_hit_beside_cached_windows_reads_each_tail_and_stores_the_pages():
    """Cached windows with a disk tier (`window_disk`): published window
    pages are stored to host for the disk (entering no host index), and a
    disk hit ends where the probe found the tails, reading the window's
    tail at its end into the group's first granted slots; nothing is
    replayed. A hit that host room or the granularity would cut shorter
    than the probe's end reads nothing (its tail was not probed)."""
    from pdserve.scheduler.cache.groups import FULL, CacheGroupSpec

    def cached():
        p = Planner(config(page_size=4, total_pages=64, host_pages=32, sliding_pages=32,
                           max_scheduled_tokens=64),
                    groups=(FULL, CacheGroupSpec("sliding_window", 8)))
        p.coord.window_disk = True
        return p
    p = cached()
    assert p.coord.serves_disk
    r = req("a", PROMPT)
    r.disk_pages = 5                      # 20 tokens; window 8: slots 3 and 4 are its tail
    p.submit(r)
    plan = p.build()
    pages, tail = plan.disk_loads
    assert pages.group == 0 and pages.chains == chains(PROMPT, 5)
    assert tail.group == 1 and tail.chains == chains(PROMPT, 5)[3:] and tail.first_page == 3
    (ld,) = [ld for ld in plan.loads if ld.group == 1]
    assert ld.host_pages == tail.host_pages
    assert ld.device_pages == r.state.res.tables[1][3:5]
    (op,) = plan.prefills
    assert op.begin == 20 and not op.replay and r.cached == (0, 0, 20)
    p.check_invariants()
    p.apply(plan, result_for(plan))
    stored = [s for s in plan.stores if s.group == 1]
    while p.has_work():
        plan, _ = step(p)
        stored += [s for s in plan.stores if s.group == 1]
    assert stored and all(s.pinned for s in stored)
    assert p.coord.hosts[1].index.num_cached == 0  # for the disk only
    p.assert_idle()
    p = cached()
    r = req("b", PROMPT)
    r.disk_pages = 6
    p.submit(r)
    p.coord.host_cache.tiers[0].allocate(27)        # room for 5 pages, not 6
    plan = p.build()
    assert not plan.disk_loads and plan.prefills[0].begin == 0


# ---- D's remote admission (P/D) ----------------------------------------------------

def pd_pair():
    from support.pd import PDPair
    cfg = config(page_size=4, total_pages=64, host_pages=32, max_scheduled_tokens=64)
    return PDPair(cfg, cfg)


def test_d_reads_its_disk_prefix_and_asks_the_peer_only_for_the_rest():
    """D's remote admission continues its hit over the disk pages its probe
    found (read disk -> host -> device in the round) and asks P for the
    pages after them only; P ships exactly those."""
    pair = pd_pair()
    r = req("a", PROMPT)
    r.disk_pages = 5
    pair.submit(r)
    dplan, _ = pair.tick()
    (dl,) = dplan.disk_loads
    assert dl.chains == chains(PROMPT, 5) and dl.first_page == 0
    (ld,) = dplan.loads
    assert ld.host_pages == dl.host_pages
    (ask,) = dplan.remote_prefills
    assert ask.first_page == 5 and r.cached == (0, 0, 20)
    assert ld.device_pages == r.state.res.tables[0][:5]
    assert ask.landing_pages == r.state.res.tables[0][5:9]
    pair.run()
    assert [f.id for f in pair.finished] == ["a"]
    assert pair.D.hits.disk_tokens == 20
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_d_s_disk_hit_beside_a_state_group_reads_pages_only_and_asks_for_the_state():
    """A state model's landing (§1.2 with §3.2): the peer sends the final
    state whatever D found, so D's disk hit reads the full history's
    pages only (no checkpoint, not even at a block boundary) and asks P
    for the pages after them and the prompt's final state."""
    from support.pd import PDPair
    from pdserve.scheduler.cache.groups import FULL, CacheGroupSpec
    cfg = config(page_size=4, total_pages=64, host_pages=32, state_slots=16,
                 max_scheduled_tokens=64)
    pair = PDPair(cfg, cfg, groups=(FULL, CacheGroupSpec("snapshot_state", block=8)))
    assert pair.D.coord.landing_serves_disk
    r = req("a", PROMPT)
    r.disk_pages = 4                      # 16 tokens: a checkpoint boundary
    pair.submit(r)
    dplan, _ = pair.tick()
    (dl,) = dplan.disk_loads
    assert dl.group == 0 and dl.chains == chains(PROMPT, 4)
    assert [ld.group for ld in dplan.loads] == [0]
    (ask,) = dplan.remote_prefills
    assert ask.first_page == 4 and r.cached == (0, 0, 16)
    assert len(ask.landing[1]) == 1       # the final state's slot
    pair.D.check_invariants()
    pair.run()
    assert [f.id for f in pair.finished] == ["a"]
    assert pair.D.hits.disk_tokens == 16
    pair.D.assert_idle()
    pair.P.assert_idle()


def test_d_withholds_the_peer_pull_when_its_disk_read_misses():
    """Spec §4: a disk read under D's remote admission that misses retracts
    the request before its ask leaves (the loop asks only for requests
    still landing), publishes nothing of the unfilled pages, and the next
    admission asks the peer for the whole prompt."""
    pair = pd_pair()
    d = pair.D
    r = req("a", PROMPT)
    r.disk_pages = 5
    d.submit(r)
    plan = d.build()
    (dl,) = plan.disk_loads
    assert plan.remote_prefills and "a" in d.landing
    res = StepResult([], [], set(), [s.id for s in plan.stores], [ld.id for ld in plan.loads],
                     [], [dl.id])
    d.apply(plan, res)
    d.check_invariants()
    assert "a" not in d.landing and d.waiting[0] is r     # the ask is withheld
    assert r.disk_pages == 0 and r.retractions == 1 and d.hits.disk_missed == 1
    assert d.coord.match(req("b", PROMPT), 8).pages == 0  # nothing of it published
    dplan, _ = pair.tick()
    (ask,) = dplan.remote_prefills
    assert ask.first_page == 0 and not dplan.disk_loads
    pair.run()
    assert [f.id for f in pair.finished] == ["a"]
    assert d.hits.disk_tokens == 0
    d.assert_idle()
    pair.P.assert_idle()


def test_d_s_prefetch_holds_its_remote_admissions():
    pair = pd_pair()
    r = req("a", PROMPT)
    r.disk_wait = True
    pair.submit(r)
    pair.submit(req("b", 8))
    dplan, _ = pair.tick()
    assert not dplan.remote_prefills
    why = {w.req_id: w.reason for w in pair.D.waiting_reasons()}
    assert why == {"a": Hold.DISK_PREFETCH, "b": Hold.DISK_PREFETCH}
    r.disk_wait = False
    pair.run()
    assert sorted(f.id for f in pair.finished) == ["a", "b"]
    pair.D.assert_idle()


def test_d_loads_a_host_hit_and_asks_the_peer_for_the_rest():
    """A prefix D's host tier holds (its device copy evicted) is loaded
    host -> device by the remote admission, not asked of the peer."""
    from support.pd import PDPair
    cfg = config(page_size=4, total_pages=24, host_pages=32, max_scheduled_tokens=64)
    pair = PDPair(cfg, cfg)
    pair.submit(req("a", PROMPT, max_new=1))
    pair.run()
    for i in range(3):                          # others' prompts push a's pages off the device
        pair.submit(req(f"x{i}", 33, max_new=1))
        pair.run()
    r = req("b", PROMPT + [99, 98, 97, 96])
    pair.submit(r)
    dplan, _ = pair.tick()
    (ask,) = dplan.remote_prefills
    assert r.cached[1] > 0 and dplan.loads
    assert ask.first_page * 4 == sum(r.cached)
    pair.run()
    pair.D.assert_idle()
    pair.P.assert_idle()
