"""The phases a role grammar strings together, and the round they build.

`PlanBuild` is the round under construction: the output plan, the token
budget and batch slots left, whether the prefill line is sealed, and the
admission feedback (did anything fail for capacity, and who first). Every
operation enters the batch through `push_decode` / `push_prefill`, where the
accounting lives. Phases read candidates in FIFO order and schedule each
request at most once a round.
"""

from __future__ import annotations

from pdserve.scheduler import fsm
from pdserve.scheduler.chunking import admission_headroom, prefill_chunk_tokens, prefill_reserve
from pdserve.scheduler.coordinator import GroupDemand
from pdserve.scheduler.fsm import Decoding, PrefillDone, Resources
from pdserve.scheduler.plan import Plan, PrefillOp


class PlanBuild:
    __slots__ = ("plan", "budget", "batch_left", "sealed", "capacity_blocker",
                 "admission_failed", "prefill_progressed", "decodes_use_budget")

    def __init__(self, plan: Plan, budget: int, batch: int, decodes_use_budget: bool):
        self.plan = plan
        self.budget = budget
        self.batch_left = batch
        self.sealed = False              # an incomplete prefill holds the line (§1.1)
        self.capacity_blocker = None     # first request whose admission failed
        self.admission_failed = False
        self.prefill_progressed = False
        self.decodes_use_budget = decodes_use_budget

    def fail(self, req) -> None:
        self.admission_failed = True
        if self.capacity_blocker is None:
            self.capacity_blocker = req

    def push_prefill(self, op: PrefillOp, res: Resources) -> None:
        self.plan.prefills.append(op)
        self.budget -= op.tokens + op.replay
        self.batch_left -= 1
        self.prefill_progressed = True
        res.forwards_out += 1


def decode_phase(p, b: PlanBuild) -> None:
    """Every PrefillDone first decode and Decoding step, FIFO, while batch
    slots (and, where decodes spend it, token budget) last. A decode that
    stays inside its held pages does no allocator work."""
    decodes = b.plan.decodes
    limit = b.batch_left
    if b.decodes_use_budget:
        limit = min(limit, b.budget)
    if limit <= 0:
        return
    coord = p.coord
    ps = p.page_size
    n = 0
    for req in p.running.values():
        st = req.state
        if req.num_tokens > req.capacity or st.__class__ is PrefillDone:
            # crossing into a page not yet held, or the first decode (which
            # publishes the prompt's completed pages): an admission
            res = st.res
            if not coord.admit(req, res, [GroupDemand(req.num_tokens, 0)],
                               (req.num_tokens - 1) // ps, fresh=b.plan.fresh_pages):
                b.fail(req)
                continue
            if st.__class__ is PrefillDone:
                fsm.begin_decoding(req)
                st = req.state
        st.res.forwards_out += 1
        decodes.append(req)
        n += 1
        if n == limit:
            break
    b.batch_left -= n
    if b.decodes_use_budget:
        b.budget -= n


def resident_prefill_phase(p, b: PlanBuild) -> None:
    """Next chunks of prefills already admitted, FIFO. An incomplete chunk,
    or a resident that cannot advance, seals the line behind it."""
    for req in list(p.prefilling.values()):
        if b.sealed or b.batch_left <= 0:
            return
        st = req.state
        begin, target = st.window_end, st.target
        chunk = prefill_chunk_tokens(begin, target, b.budget, p.page_size)
        if chunk == 0:
            b.sealed = True
            return
        end = begin + chunk
        completes = end == target
        reserve = prefill_reserve(
            decodes_locally=p.decodes_locally, first_chunk=False, completes=completes,
            rest_of_prompt=target - end, headroom=0, decode_width=p.cfg.decode_input_tokens)
        if not p.coord.admit(req, st.res, [GroupDemand(end, reserve)], begin // p.page_size,
                             fresh=b.plan.fresh_pages):
            b.fail(req)
            b.sealed = True
            return
        res = st.res
        fsm.advance_prefill(req, end)
        b.push_prefill(PrefillOp(req, begin, chunk, completes), res)
        if completes:
            p.prefill_completed(req)
        else:
            b.sealed = True


def new_prompt_phase(p, b: PlanBuild) -> None:
    """Admit waiting requests in FIFO order, each with its first chunk. The
    first one that does not fit stops the phase: nobody overtakes it."""
    waiting = p.waiting
    ps = p.page_size
    cfg = p.cfg
    while waiting and not b.sealed and b.budget > 0 and b.batch_left > 0:
        req = waiting[0]
        target = req.num_tokens
        hit = p.coord.match(req, (target - 1) // ps)
        begin = len(hit) * ps
        chunk = prefill_chunk_tokens(begin, target, b.budget, ps)
        if chunk == 0:
            b.sealed = True
            return
        end = begin + chunk
        completes = end == target
        remaining = req.remaining_new_tokens
        if req.limits.strict:
            headroom = remaining
        else:
            headroom = admission_headroom(remaining, cfg.safe_steps, req.retractions)
        reserve = prefill_reserve(
            decodes_locally=p.decodes_locally, first_chunk=True, completes=completes,
            rest_of_prompt=target - end, headroom=headroom,
            decode_width=cfg.decode_input_tokens)
        res = Resources(len(p.coord.groups))
        if not p.coord.admit(req, res, [GroupDemand(end, reserve)], len(hit), hit=hit,
                             fresh=b.plan.fresh_pages):
            b.fail(req)
            b.sealed = True
            return
        res.secured_tokens = end + reserve
        res.budget_at_admission = remaining
        waiting.popleft()
        p.take_slot(req)
        fsm.start_prefill(req, res, end, target)
        b.push_prefill(PrefillOp(req, begin, chunk, completes), res)
        if completes:
            p.prefill_completed(req)
        else:
            p.prefilling[req.id] = req
            b.sealed = True


__all__ = ["PlanBuild", "decode_phase", "resident_prefill_phase", "new_prompt_phase",
           "Decoding"]
