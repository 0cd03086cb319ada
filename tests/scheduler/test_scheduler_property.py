"""Property test (spec §5): random workloads through the fused planner,
invariants checked after every round, every request ends, nothing leaks.
Each workload draws its cache groups too: full history alone, beside a
sliding window (cached or replayed, §1.3), sliding windows alone, or full
history beside a snapshot-state group (§1.2) with or without a window.

Every copy (a host load or store, a P -> D transfer's landing) is
acknowledged a number of rounds after the plan that asked for it, drawn
per copy, as an executor with asynchronous copies reports them (issue 34):
a page under an unacked copy is its ticket's until then, and the
invariants check that every round. `HYPOTHESIS_PROFILE=deep` digs further
(docs/reliability.md has the command and what it found)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.scheduler.plan import Plan, StepResult

from pdserve.scheduler import Planner, Request, SamplingLimits
from pdserve.scheduler.cache.groups import FULL, CacheGroupSpec, replay_window
from pdserve.scheduler.capacity import sliding_request_pages
from pdserve.scheduler.fsm import Prefilling

from support.planner import config, req, result_for

PREFIXES = [[7] * 12, [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3]]
# rounds a copy's ack is withheld, drawn per copy: most come back in their round
DELAYS = [0, 0, 0, 1, 1, 2, 3, 6]


class LateAcks:
    """An executor's copy acks, each withheld a number of rounds drawn per
    copy (`rng`: hypothesis's, so a failure shrinks and replays)."""

    def __init__(self, rng):
        self.rng = rng
        self.round = 0
        self.held: list = []      # (due round, "store" | "load", op id)

    def pending(self) -> bool:
        return bool(self.held)

    def delay(self) -> int:
        return self.rng.choice(DELAYS)

    def result(self, plan: Plan, stopped=()) -> StepResult:
        """What the executor reports for `plan`: its forwards' tokens and
        whichever acks fall due this round (its own copies' or earlier)."""
        self.round += 1
        res = result_for(plan, stopped=stopped, ack=False)
        self.held += [(self.round + self.delay(), "store", s.id) for s in plan.stores]
        self.held += [(self.round + self.delay(), "load", ld.id) for ld in plan.loads]
        due = [h for h in self.held if h[0] <= self.round]
        self.held = [h for h in self.held if h[0] > self.round]
        res.stores_done = [i for _, kind, i in due if kind == "store"]
        res.loads_done = [i for _, kind, i in due if kind == "load"]
        return res


def sliding(window, replay=False):
    return CacheGroupSpec("sliding_window", window, replayable=replay)


def state(block):
    return CacheGroupSpec("snapshot_state", block=block)


def mla_group() -> CacheGroupSpec:
    """The one group DeepSeek-V3's latent attention makes (every layer, full
    history, one latent entry a token): its pages are smaller, the rules
    the same."""
    import dataclasses

    from pdserve.kernels.models.model_config import tiny_config
    from pdserve.kernels.models.moe.specs import MlaSpec

    cfg = dataclasses.replace(tiny_config(), num_layers=5, num_kv_heads=1, head_dim=576,
                              mla=MlaSpec(1536, 512, 128, 64, 128, True, 192 ** -0.5))
    (group,) = cfg.cache_groups()
    assert cfg.kv_parts == 1 and group.keeps_history and group.layers == tuple(range(5))
    return group


MLA = mla_group()


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
        (FULL, state(block)), (FULL, state(block)), (FULL, sliding(w), state(block)),
        (MLA,)]))
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
    aborts = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 40)), max_size=3))
    return cfg, reqs, aborts, groups


@settings()
@given(workloads(), st.randoms(use_true_random=False))
def test_random_fused_workloads_end_with_every_request_done_and_nothing_held(w, rng):
    cfg, reqs, aborts, groups = w
    acks = LateAcks(rng)
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
        for i, at in aborts:
            if at == rnd and f"r{i}" in p.requests:
                p.abort(f"r{i}")                  # at any moment, copies in flight or not
                ended.add(f"r{i}")
                p.check_invariants()
        if not p.has_work() and not pending:
            break
        plan = p.build()
        if p.has_work() and not acks.pending():
            assert not plan.is_empty(), "a round built nothing while requests wait"
        prefills = plan.prefills
        assert all(op.completes for op in prefills[:-1]), "only the last chunk may be truncated"
        if prefills and not prefills[-1].completes:
            assert isinstance(prefills[-1].req.state, Prefilling)
        stopped = {r for r in plan.decodes if stop_at[r.id] == len(r.output) + 1}
        for op in prefills:
            if op.completes and stop_at[op.req.id] == len(op.req.output) + 1:
                stopped.add(op.req)
        for r in p.apply(plan, acks.result(plan, stopped)):
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
@given(tight_workloads(), st.lists(st.tuples(st.integers(0, 9), st.integers(0, 60)), max_size=2),
       st.randoms(use_true_random=False))
def test_tight_pools_with_retraction_finish_everything_within_the_retraction_bound(w, aborts,
                                                                                   rng):
    cfg, reqs, groups = w
    acks = LateAcks(rng)
    p = Planner(cfg, groups=groups)
    pending = sorted(reqs, key=lambda r: r[3])
    live, aborted = {}, set()
    for rnd in range(20000):
        while pending and pending[0][3] <= rnd:
            rid, prompt, max_new, _, strict = pending.pop(0)
            live[rid] = req(rid, prompt, max_new=max_new, strict=strict)
            p.submit(live[rid])
        for i, at in aborts:
            # a retracted victim, a readmission whose load is unacked: any moment
            if at == rnd and f"r{i}" in p.requests:
                p.abort(f"r{i}")
                aborted.add(f"r{i}")
                p.check_invariants()
        if not p.has_work() and not pending:
            break
        plan = p.build()
        if p.has_work() and not acks.pending():
            assert not plan.is_empty(), "a round built nothing while requests wait"
        p.apply(plan, acks.result(plan))
        p.check_invariants()
    else:
        raise AssertionError("did not finish")
    assert p.stalls == []
    for r in live.values():
        if r.id in aborted:
            continue
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


def late_pd_pair(p_cfg, d_cfg, groups, rng):
    """A PDPair (pd_support.py) whose copies on either side, and whose
    transfers' landings on D, report back a drawn number of rounds late."""
    from support.pd import PDPair

    class LatePDPair(PDPair):
        def __init__(self):
            super().__init__(p_cfg, d_cfg, groups=groups)
            self.d_acks, self.p_acks = LateAcks(rng), LateAcks(rng)
            self.arriving = []       # (ticks left, req id, first token): shipped, not seen

        def pending(self) -> bool:
            return bool(self.d_acks.pending() or self.p_acks.pending() or self.arriving)

        def tick(self):
            dplan = self.D.build()
            for op in dplan.remote_prefills:
                r = op.req
                twin = Request(r.id, r.prompt, SamplingLimits(max_new_tokens=1))
                twin.first_page = op.first_page
                self.landing[r.id] = [len(pages) for pages in op.landing]
                self.P.submit(twin)
            self.finished += self.D.apply(dplan, self.d_acks.result(dplan))
            pplan = self.P.build()
            self.P.apply(pplan, self.p_acks.result(pplan))
            for op in pplan.remote_decodes:
                assert [len(pages) for pages in op.src] == self.landing.pop(op.req.id), op.req
                self.arriving.append((self.d_acks.delay(), op.req.id, op.first_token))
            # an arrival whose request both sides let go meanwhile (D's abort
            # reached P) has nobody left to tell
            self.in_flight = [(rid, tok) for left, rid, tok in self.arriving if left <= 0
                              if rid in self.D.requests or rid in self.P.requests]
            self.arriving = [(left - 1, rid, tok) for left, rid, tok in self.arriving if left > 0]
            self.deliver()
            self.expire_leases()
            self.D.check_invariants()
            self.P.check_invariants()
            return dplan, pplan

    return LatePDPair()


@settings()
@given(pd_workloads(), st.randoms(use_true_random=False))
def test_random_pd_workloads_with_failures_end_every_request_and_leak_nothing(w, rng):
    p_cfg, d_cfg, reqs, groups = w
    pair = late_pd_pair(p_cfg, d_cfg, groups, rng)
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
        if not (pending or pair.D.has_work() or pair.P.has_work() or pair.in_flight
                or pair.pending()):
            break
        waits = pair.pending()
        dplan, pplan = pair.tick()
        if not pending and not waits:
            assert not (dplan.is_empty() and pplan.is_empty()), "both sides stalled"
    else:
        raise AssertionError("did not finish")
    for r in live.values():
        assert r.finish_reason in ("length", "abort"), r
        if r.finish_reason == "length":
            assert len(r.output) == r.max_new_tokens
    pair.D.assert_idle()
    pair.P.assert_idle()
