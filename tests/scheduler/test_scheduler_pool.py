"""The page pool and prefix index: refcounts, leaf-only LRU eviction,
matches that do not restamp, and check_invariants()."""

import pytest

from pdserve.scheduler.cache.coordinator import Coordinator
from pdserve.scheduler.cache.group_pools import FullHistoryGroup, GroupDemand
from pdserve.scheduler.fsm import Resources
from pdserve.scheduler.cache.pool import PagePool, PoolError
from pdserve.scheduler.plan import Plan
from pdserve.scheduler.cache.prefix import ROOT_HASH, PrefixIndex

from support.planner import req


def coord(total=16, page=4):
    return Coordinator([FullHistoryGroup(total, page)])


def admit_whole(c, r, publish=True):
    res = Resources(1)
    assert c.admit(r, res, [GroupDemand(r.prompt_len, 0)],
                   r.prompt_len // 4 if publish else 0, Plan(0))
    return res


def test_free_list_hands_out_each_page_once():
    pool = PagePool(8)
    a, b = pool.take(3), pool.take(5)
    assert sorted(a + b) == list(range(8))
    with pytest.raises(PoolError):
        pool.take(1)


def test_the_pool_hands_out_runs_in_ascending_order_and_takes_them_back_so():
    """A transfer names a run of pages ascending on both sides as one
    descriptor (NIXL merges it; a descending run it does not): a fresh
    pool's takes are ascending runs, one after another, and a run dropped
    back comes out again as the same ascending run."""
    from pdserve.scheduler.cache.pool import drop_refs

    class NoIndex:
        def contains(self, page):
            return False

    pool = PagePool(16)
    a, b = pool.take(5), pool.take(3)
    assert a == [0, 1, 2, 3, 4] and b == [5, 6, 7]
    drop_refs(pool, NoIndex(), a)
    assert pool.take(5) == a
    drop_refs(pool, NoIndex(), b)
    assert pool.take(8) == [5, 6, 7, 8, 9, 10, 11, 12]
    assert pool.take(3) == [13, 14, 15] and pool.take(0) == []


def test_a_fresh_prompt_lands_on_d_as_one_run_from_one_run_on_p():
    """P/D through the planners: each of the first requests' transfers is
    one run on both sides (its chunks' pages follow each other on P, its
    landing pages on D), so NIXL moves it as one descriptor."""
    from pdserve.transfer.transport import page_runs
    from support.pd import PDPair
    from support.planner import config

    pair = PDPair(config(max_scheduled_tokens=16), config(max_scheduled_tokens=16))
    pair.submit(req("a", 40))                       # 10 pages of 4, in three chunks on P
    landing, runs = {}, []
    for _ in range(20):
        dplan, pplan = pair.tick()
        landing.update((op.req.id, op.landing) for op in dplan.remote_prefills)
        runs += [page_runs(s, d) for op in pplan.remote_decodes
                 for s, d in zip(op.src, landing.pop(op.req.id))]
    assert runs == [[(0, 0, 10)]]


def test_freeing_a_held_page_is_refused():
    pool = PagePool(4)
    (p,) = pool.take(1)
    with pytest.raises(PoolError):
        pool.put_free(p)


def test_release_returns_unpublished_pages_to_the_free_list():
    c = coord()
    res = admit_whole(c, req("a", 8), publish=False)
    assert c.groups[0].pool.num_free == 14
    c.release(res)
    assert c.groups[0].pool.num_free == 16
    c.check_invariants([])


def test_published_pages_stay_cached_after_release_and_count_as_free():
    c = coord()
    r = req("a", 8)
    res = admit_whole(c, r)
    c.release(res)
    g = c.groups[0]
    assert g.index.num_cached == 2 and g.pool.num_free == 14
    assert c.free_pages() == 16
    assert len(c.match(r, 2).device[0]) == 2
    c.check_invariants([])


def test_match_does_not_restamp_lru():
    c = coord(total=4)
    a, b = req("a", 4), req("b", 4)
    c.release(admit_whole(c, a))     # a's page idles first: older
    c.release(admit_whole(c, b))
    assert c.match(a, 1).device[0]          # probing a must not make it younger
    res = Resources(1)
    # 3 pages: the 2 free ones, then one eviction, which must take a's page
    assert c.admit(req("x", 12), res, [GroupDemand(12, 0)], 0, Plan(0))
    assert c.match(a, 1).device[0] == [] and len(c.match(b, 1).device[0]) == 1
    c.check_invariants([res.tables])


def test_eviction_takes_the_least_recently_released_leaf_first():
    c = coord(total=3)
    a, b = req("a", 4), req("b", 4)
    c.release(admit_whole(c, a))
    c.release(admit_whole(c, b))
    res = Resources(1)
    assert c.admit(req("x", 8), res, [GroupDemand(8, 0)], 0, Plan(0))  # 1 free + evict 1
    assert c.match(a, 1).device[0] == []          # a idled first: evicted
    assert len(c.match(b, 1).device[0]) == 1


def test_a_parent_is_never_evicted_before_its_children():
    pool = PagePool(4)
    idx = PrefixIndex(pool)
    p0, p1 = pool.take(2)
    h0 = idx.insert(ROOT_HASH, "k0", p0)
    assert h0 is not None and idx.insert(h0, "k1", p1) is not None
    # release the parent first so it carries the older stamp
    for p in (p0, p1):
        pool.refcount[p] = 0
        idx.idle(p)
    assert idx.evict(1) == [p1]         # the leaf goes, though the parent is older
    assert idx.evict(1) == [p0]
    idx.check_invariants()


def test_a_page_held_by_a_live_request_is_never_evicted():
    c = coord(total=4)
    r = req("a", 8)
    res = admit_whole(c, r)             # 2 pages held and published
    other = Resources(1)
    assert not c.admit(req("x", 12), other, [GroupDemand(12, 0)], 0, Plan(0))  # needs 3, 2 free
    assert c.match(r, 2).device[0] == res.tables[0]
    assert other.tables == [[]]


def test_a_failed_admission_changes_nothing():
    c = coord(total=4)
    r = req("a", 16)
    res = Resources(1)
    before = (list(c.groups[0].pool.refcount), c.groups[0].pool.num_free)
    assert not c.admit(r, res, [GroupDemand(16, 4)], 0, Plan(0))
    assert res.tables == [[]] and res.published == 0
    assert (list(c.groups[0].pool.refcount), c.groups[0].pool.num_free) == before


def test_admission_publishes_the_pages_completed_since_the_last_one():
    c = coord()
    r = req("a", 16)
    res = Resources(1)
    assert c.admit(r, res, [GroupDemand(8, 0)], 0, Plan(0))     # chunk [0, 8)
    assert c.groups[0].index.num_cached == 0
    assert c.admit(r, res, [GroupDemand(16, 0)], 2, Plan(0))    # next chunk publishes [0, 8)
    assert c.groups[0].index.num_cached == 2 and res.published == 2
    c.check_invariants([res.tables])


def test_a_prefix_hit_claims_cached_pages_and_counts_them_against_room():
    c = coord(total=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8])
    c.release(admit_whole(c, a))
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
    hit = c.match(b, 3)
    assert hit.pages == 2
    res = Resources(1)
    # 4 pages needed, 2 of them the hit; the other 2 come from the free list
    assert c.admit(b, res, [GroupDemand(16, 0)], 2, Plan(0), hit=hit)
    assert res.tables[0][:2] == hit.device[0] and c.free_pages() == 0
    c.check_invariants([res.tables])


def test_a_duplicate_publication_adopts_the_cached_page_and_goes_on():
    """b computed the same first two pages as a: publishing them, b holds
    a's cached pages instead of its copies (which go back), and its third
    page, new content, is cached under them."""
    c = coord()
    a, b = req("a", [1, 2, 3, 4, 5, 6, 7, 8]), req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9])
    ra, rb = admit_whole(c, a, publish=False), admit_whole(c, b, publish=False)
    own = list(rb.tables[0])
    free = c.free_pages()
    c.publish(a, ra, 2)
    c.publish(b, rb, 3)
    assert rb.tables[0] == ra.tables[0] + own[2:] and rb.publishing
    assert c.groups[0].index.num_cached == 3 and c.free_pages() == free + 2
    assert c.match(req("c", [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 5]), 3).pages == 3
    c.check_invariants([ra.tables, rb.tables])
    c.release(ra)
    c.release(rb)
    c.check_invariants([])
    assert c.free_pages() == 16


def test_check_invariants_catches_a_leaked_refcount():
    c = coord()
    res = admit_whole(c, req("a", 8))
    with pytest.raises(PoolError):
        c.check_invariants([])          # the pages are held by a table it was not told of
    c.check_invariants([res.tables])


@pytest.mark.parametrize("page", [2, 4, 16])
def test_prompts_that_differ_only_in_a_page_s_last_token_never_share_that_page(page):
    """A page's key holds every one of its tokens, its last included: b
    differs from a only in token `page - 1` and shares no cached page with
    it, while c, a's very prompt, hits both of a's pages."""
    c = coord(total=8, page=page)
    a = req("a", list(range(1, 2 * page + 1)))
    res = Resources(1)
    assert c.admit(a, res, [GroupDemand(a.prompt_len, 0)], 2, Plan(0))
    c.release(res)
    b_prompt = list(a.prompt.tokens)
    b_prompt[page - 1] += 100
    assert c.match(req("b", b_prompt), 2).pages == 0
    assert c.match(req("c", list(a.prompt.tokens)), 2).pages == 2
    c.check_invariants([])


@pytest.mark.parametrize("page", [2, 4, 16])
def test_a_page_that_straddles_the_prompt_s_end_is_keyed_by_its_last_output_token(page):
    """A page that holds the prompt's tail and the first outputs is keyed
    by all of them: two requests of one prompt whose outputs differ only
    in the page's last token have different keys for it; and a full
    page's key stays what it was as the request grows past it."""
    prompt = list(range(1, page + page // 2 + 1))
    a, b = req("a", prompt), req("b", prompt)
    for r, last in ((a, 7), (b, 8)):
        r.output.extend([5] * (page - page // 2 - 1) + [last])
    assert a.page_key(0, page) == b.page_key(0, page)
    assert a.page_key(1, page) != b.page_key(1, page)
    key = a.page_key(1, page)
    a.output.extend([9] * page)
    assert a.page_key(1, page) == key
