"""The disk (L3) tier as the planner sees it (spec §1, §4): a request
carries what the engine's probe found (`disk_pages`, `disk_wait`), and
admission reads those pages disk -> host -> device in the round, shortened
to what the host tier can stage and rounded down to the prefix
granularity; a read that misses retracts the request, publishing nothing
of it, and it re-prefills."""

from pdserve.scheduler import Planner
from pdserve.scheduler.plan import StepResult
from pdserve.scheduler.prefix import ROOT_HASH, chain_hash
from pdserve.scheduler.waiting import Hold

from support import config, req, result_for, run_to_completion, step


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


def test_a_model_with_other_cache_groups_reads_nothing_from_disk():
    from pdserve.scheduler.cache_groups import FULL, CacheGroupSpec
    p = Planner(config(page_size=4, total_pages=64, host_pages=32, state_slots=16),
                groups=(FULL, CacheGroupSpec("snapshot_state", block=8)))
    r = req("a", PROMPT)
    r.disk_pages = 5
    p.submit(r)
    plan = p.build()
    assert not plan.disk_loads and plan.prefills[0].begin == 0
