"""The decode phase: every first decode and decoding step of the round,
FIFO, with speculation's verify rows and overlap's decodes that go again."""

from __future__ import annotations

import pdserve.scheduler.fsm as fsm
from pdserve.scheduler.cache.demands import demands
from pdserve.scheduler.fsm import PrefillDone, RemotePrefillDone
from pdserve.scheduler.plan_state import PlannerState
from pdserve.scheduler.round.build import PlanBuild
from pdserve.scheduler.round.overlap import runs_ahead
from pdserve.scheduler.speculation import verify_width

FIRST_DECODE = (PrefillDone, RemotePrefillDone)


def try_decode(p: PlannerState, b: PlanBuild, req, width: int = 0) -> bool:
    """Admit the page a decode crosses into (a verify row: every page its
    `width` candidates write too), and, on the first decode, publish the
    prompt's pages; False if the pool cannot supply it."""
    st = req.state
    ps = p.page_size
    n = req.num_tokens
    if not p.coord.admit(req, st.res, demands(p, n - 1, n + width, 0, 0, decode=True),
                         (n - 1) // ps, b.plan):
        return False
    if st.__class__ in FIRST_DECODE:
        fsm.begin_decoding(req)
    return True


def decode_phase(p: PlannerState, b: PlanBuild) -> None:
    """Every PrefillDone first decode and Decoding step, FIFO, while batch
    slots (and, where decodes spend it, token budget) last. A decode that
    stays inside its held pages does no allocator work."""
    if not b.can_decode():
        return
    limit = b.batch_left
    tokens = None                           # the budget decodes may spend (None: no budget)
    if b.decodes_use_budget:
        # with bounded replay a hit's first chunk needs its replay rows and
        # a page beside them: leave that much for a prefill waiting (§1.3)
        keep = p.min_prefill_tokens if (p.waiting or p.prefilling) else 0
        tokens = max(b.budget - keep, 1 if not b.plan.prefills else 0)
        limit = min(limit, tokens)
    decodes = b.plan.decodes
    n = extra = 0
    for req in p.running.values():
        st = req.state
        assert isinstance(st, fsm.Holding)      # running: PrefillDone, Decoding, RemotePrefillDone
        width = 0
        if st.res.forwards_out:
            if not runs_ahead(p, b.plan, req):  # engine.overlap: a decode in flight goes again
                continue
        else:
            if req.drafts:                  # a verify row (speculation.py)
                width = verify_width(req, None if tokens is None else tokens - n - extra)
            if req.num_tokens + width > req.capacity or st.__class__ in FIRST_DECODE:
                # short of pages for the candidates, a plain decode may still fit
                if not try_decode(p, b, req, width) and not (
                        width and req.num_tokens > req.capacity and try_decode(p, b, req)):
                    b.fail(req)
                    continue
                if req.num_tokens + width > req.capacity:
                    width = 0
                st = req.state
                assert isinstance(st, fsm.Holding)  # try_decode began its decoding
        st.res.forwards_out += 1
        decodes.append(req)
        if width:
            b.plan.verify[req.id] = req.drafts[:width]
            extra += width
        n += 1
        if n == limit or (tokens is not None and n + extra >= tokens):
            break
    b.batch_left -= n
    if b.decodes_use_budget:
        b.budget -= n + extra
