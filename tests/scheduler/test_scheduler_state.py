"""Snapshot-state groups (spec §1 reserves, §1.2 state checkpoints): which
slots a request holds, which checkpoints are recorded, published and hit,
round by round on the planner alone."""

import pytest

from pdserve.scheduler import Planner
from pdserve.scheduler.cache.groups import FULL, HOLE, CacheGroupSpec
from pdserve.scheduler.config import ConfigError
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.cache.prefix import ROOT_HASH, chain_hash

from support.planner import config, req, result_for, run_to_completion, step

PS = 4          # page size
B = 8           # state block: two pages


def state(block=B):
    return CacheGroupSpec("snapshot_state", block=block)


def planner(role=Role.FUSED, block=B, **kw):
    base = dict(page_size=PS, total_pages=128, max_scheduled_tokens=64)
    base.update(kw)
    return Planner(config(**base), role, groups=(FULL, state(block)))


def held(table):
    return {i: s for i, s in enumerate(table) if s != HOLE}


def cached_boundaries(p, tokens):
    """The block boundaries of `tokens` whose state checkpoint is cached."""
    grp = p.coord.groups[1]
    out, h = [], ROOT_HASH
    for i in range(len(tokens) // PS):
        h = chain_hash(h, tuple(tokens[i * PS:(i + 1) * PS]))
        if (i + 1) * PS % B == 0 and grp.index.find(h) is not None:
            out.append((i + 1) * PS)
    return out


def test_one_forward_leaves_the_last_aligned_checkpoint_and_the_final_state():
    """§1.2: a 50-token prompt in one forward materializes the state at 48
    (the last block boundary inside it) and its final state at 50; the
    boundaries it merely crosses get no slot."""
    p = planner()
    r = req("a", 50, max_new=3)
    p.submit(r)
    plan, _ = step(p)
    assert [op.tokens for op in plan.prefills] == [50]
    grp = p.coord.groups[1]
    # entries: the checkpoint at 48 (block 5) and the final state (block 6),
    # plus the growth block a decoding role reserves (block 7)
    assert sorted(held(r.state.res.tables[1])) == [grp.entry(48), grp.entry(50),
                                                     grp.entry(57)] == [11, 13, 15]
    assert r.state.res.marks == {grp.entry(48)}
    step(p)                      # the first decode publishes the prompt's pages
    assert cached_boundaries(p, r.prompt.tokens) == [48]
    assert r.state.res.marks == set()
    # the checkpoint and nothing before the working state stays held
    assert sorted(held(r.state.res.tables[1])) == [13, 15]
    run_to_completion(p)
    p.assert_idle()


def test_chunks_end_on_block_boundaries_and_each_aligned_end_is_a_checkpoint():
    p = planner(max_scheduled_tokens=20)
    r = req("a", 50, max_new=2)
    p.submit(r)
    chunks = []
    while p.has_work():
        plan, _ = step(p)
        chunks += [(op.begin, op.tokens) for op in plan.prefills]
    # 20 tokens of budget reach the boundary at 16, not the page at 20; the
    # last 18 fit the budget and run in one forward that also leaves 48's state
    assert chunks == [(0, 16), (16, 16), (32, 18)]
    assert cached_boundaries(p, r.prompt.tokens) == [16, 32, 48]
    p.assert_idle()


def test_a_hit_restores_the_nearest_checkpoint_and_recomputes_from_there():
    """The full history caches 11 pages of the first prompt; the state only
    its checkpoint at 40, so the second request resumes there."""
    p = planner()
    a = req("a", 46, max_new=1)
    p.submit(a)
    run_to_completion(p)
    assert cached_boundaries(p, a.prompt.tokens) == [40]
    b = req("b", a.prompt.tokens + [3, 4, 5], max_new=2)
    p.submit(b)
    plan, _ = step(p)
    op = plan.prefills[0]
    assert (op.begin, op.tokens) == (40, 9)
    grp = p.coord.groups[1]
    table = b.state.res.tables[1]
    assert held(table)[grp.entry(40)] == grp.index.find(
        _hash_of(b.prompt.tokens, 40))
    run_to_completion(p)
    p.assert_idle()


def _hash_of(tokens, n):
    h = ROOT_HASH
    for i in range(n // PS):
        h = chain_hash(h, tuple(tokens[i * PS:(i + 1) * PS]))
    return h


def test_no_state_checkpoint_no_hit_even_with_full_history_cached():
    """A prompt shorter than one block leaves no checkpoint: the next one
    recomputes from zero although its K/V pages are cached (§1.2: a hit
    never needs a state the cache lacks)."""
    p = planner()
    a = req("a", 7, max_new=1)
    p.submit(a)
    run_to_completion(p)
    b = req("b", a.prompt.tokens + [9, 9, 9], max_new=1)
    p.submit(b)
    plan, _ = step(p)
    assert plan.prefills[0].begin == 0
    run_to_completion(p)
    p.assert_idle()


def test_decode_holds_two_slots_and_records_no_checkpoint():
    p = planner()
    r = req("a", 8, max_new=40)
    p.submit(r)
    peak = 0
    while p.has_work():
        step(p)
        if r.state.holds_pages:
            peak = max(peak, len(held(r.state.res.tables[1])))
            assert r.state.res.marks == set() or r.num_tokens <= 9
    # the prompt's end (8) is the only checkpoint: decode publishes none
    tokens = r.prompt.tokens + r.output
    assert cached_boundaries(p, tokens) == [8]
    assert peak <= 2
    p.assert_idle()


def test_the_prefill_role_reserves_no_growth_block():
    p = planner(role=Role.PREFILL)
    r = req("a", 50, max_new=3)
    p.submit(r)
    step(p)
    grp = p.coord.groups[1]
    assert sorted(held(r.state.res.tables[1])) == [grp.entry(48), grp.entry(50)]


def test_retraction_snapshots_only_the_working_state_and_readmission_loads_it():
    # three decoders outgrow a 12-page pool with headroom of 4: one is retracted
    p = planner(total_pages=12, host_pages=64, safe_steps=4)
    for rid in "abc":
        p.submit(req(rid, 6, max_new=30))
    for _ in range(200):
        plan, _ = step(p)
        if plan.retracts:
            break
    (rop,) = plan.retracts
    victim = rop.req
    assert rop.stored
    grp = p.coord.groups[1]
    snap = victim.state.snapshot[1]
    computed = victim.state.computed
    # the state group's snapshot is the working state alone
    assert [i for i, s in enumerate(snap) if s != HOLE] == [grp.entry(computed)]
    tokens_before = victim.num_tokens
    for _ in range(500):
        plan, _ = step(p)
        if victim in plan.readmits:
            break
    state_loads = [ld for ld in plan.loads if ld.group == 1]
    assert len(state_loads) == 1 and len(state_loads[0].device_pages) == 1
    # resumed from the loaded state: only the token it had not fed runs
    assert [(op.begin, op.tokens) for op in plan.prefills if op.req is victim] == \
        [(tokens_before - 1, 1)]
    run_to_completion(p)
    assert len(victim.output) == 30
    p.assert_idle()


def test_a_state_block_the_budget_cannot_reach_is_refused():
    with pytest.raises(ConfigError, match="state block"):
        planner(max_scheduled_tokens=8, block=16)
    with pytest.raises(ConfigError, match="state_slots"):
        planner(state_slots=3)
    with pytest.raises(ConfigError, match="multiple of the page size"):
        planner(block=6)


def test_pd_lands_the_final_state_alone_and_d_publishes_an_aligned_endpoint():
    from support.pd import PDPair

    pair = PDPair(config(page_size=PS, total_pages=128, max_scheduled_tokens=64),
                  config(page_size=PS, total_pages=128, max_scheduled_tokens=64),
                  groups=(FULL, state()))
    r = req("a", 48, max_new=4)
    pair.submit(r)
    landing = []
    while pair.D.has_work() or pair.P.has_work() or pair.in_flight:
        dplan, _ = pair.tick()
        landing += [[len(pages) for pages in op.landing] for op in dplan.remote_prefills]
    # the state travels as one slot, the final state at 48, an aligned endpoint
    # which D publishes as its own checkpoint (P publishes it too)
    assert landing == [[12, 1]]
    assert cached_boundaries(pair.D, r.prompt.tokens) == [48]
    assert cached_boundaries(pair.P, r.prompt.tokens) == [48]
    pair.P.assert_idle()
    pair.D.assert_idle()


def test_with_checkpoints_off_nothing_is_cached_and_nothing_hits():
    p = planner(state_checkpoints=False)
    a = req("a", 46, max_new=1)
    p.submit(a)
    run_to_completion(p)
    assert cached_boundaries(p, a.prompt.tokens) == []
    assert p.coord.groups[1].index.num_cached == 0
    b = req("b", a.prompt.tokens + [3, 4, 5], max_new=2)
    p.submit(b)
    plan, _ = step(p)
    # the K/V pages are cached, but no state to resume from: all recomputed
    assert plan.prefills[0].begin == 0
    run_to_completion(p)
    p.assert_idle()


def test_checkpoints_go_to_host_and_a_hit_the_device_evicted_loads_from_there():
    """L2: a published checkpoint is stored to the state group's host tier
    (pinned until the ack); once the device evicts it, a hit still resumes
    there, loading the state into the slot its forward reads."""
    p = planner(state_slots=5, host_pages=64)
    a = req("a", 46, max_new=1)
    p.submit(a)
    stored = []
    while p.has_work():
        plan, _ = step(p)
        stored += [s for s in plan.stores if s.group == 1]
    assert stored and all(s.pinned for s in stored)
    assert p.coord.hosts[1].index.find(_hash_of(a.prompt.tokens, 40)) is not None
    for i in range(4):                  # other prompts take every device slot
        p.submit(req(f"x{i}", 40, max_new=1))
        run_to_completion(p)
    assert cached_boundaries(p, a.prompt.tokens) == []
    b = req("b", a.prompt.tokens + [3, 4, 5], max_new=2)
    p.submit(b)
    plan, _ = step(p)
    assert (plan.prefills[0].begin, plan.prefills[0].tokens) == (40, 9)
    (load,) = [ld for ld in plan.loads if ld.group == 1]
    grp = p.coord.groups[1]
    assert load.device_pages == [b.state.res.tables[1][grp.entry(40)]]
    run_to_completion(p)
    p.assert_idle()


def test_a_retracted_blocker_hands_its_room_to_the_prefill_it_held_back():
    """Found by the deep property profile: with 5 state slots, the first of
    two admitted prefills could never fit its completing chunk (a
    checkpoint, a final state and a growth block) and was retracted and
    readmitted every round, while the second, retraction-exempt and held
    behind it by head of line, never ran. The room a blocker's own
    retraction frees now goes to that second prefill first."""
    cfg = dict(page_size=2, total_pages=25, host_pages=13, max_scheduled_tokens=4,
               max_batch_size=2, safe_steps=2, state_slots=5)
    p = Planner(config(**cfg), groups=(FULL, state(2)))
    r5 = [9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 45, 44, 6, 39, 24, 44, 9, 26, 33, 10, 9,
          21, 33, 35, 6, 36]
    reqs = [("r0", [37, 36], 16, 3, True), ("r1", [9], 5, 19, True),
            ("r2", [45, 44, 6, 39, 24, 44, 9, 26, 33, 10, 30, 21, 33, 35, 6, 36], 12, 13, False),
            ("r3", [1, 2, 3, 4, 5, 6, 7, 8, 46, 25, 35, 50, 17], 1, 10, True),
            ("r4", [3, 23, 23, 46, 2], 1, 20, False), ("r5", r5, 20, 5, False),
            ("r6", [50, 2, 44, 34, 43, 37, 16, 7, 1, 5, 27], 20, 8, False),
            ("r7", [14, 49], 31, 15, False)]
    pending = sorted(reqs, key=lambda r: r[3])
    for rnd in range(1000):
        while pending and pending[0][3] <= rnd:
            rid, prompt, max_new, _, strict = pending.pop(0)
            p.submit(req(rid, prompt, max_new=max_new, strict=strict))
        if not p.has_work() and not pending:
            break
        plan = p.build()
        p.apply(plan, result_for(plan))
        p.check_invariants()
    else:
        raise AssertionError("the workload never finished")
    assert p.stalls == []
    p.assert_idle()
