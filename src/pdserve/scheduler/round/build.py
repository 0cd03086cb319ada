"""The round under construction (`PlanBuild`): the output plan, the token
budget and batch slots left, which lines are sealed, and the admission
feedback (did anything fail for capacity, and who first). Every operation
enters the batch through `push_decode` / `push_prefill`, where the
accounting lives.

The phases that fill it (decode.py, prefill.py, remote.py) read candidates
in FIFO order and schedule each request at most once a round. Each `try_*`
helper admits one request or changes nothing; the phases call them in
order, and retraction (retraction.py) calls them again to retry the request
it freed room for. Where a phase stops the waiting line or tries a
readmission, it notes the rule in `PlanBuild.waits` (waiting.py) for the
operator's `Planner.waiting_reasons()`; the plan never reads it.
"""

from __future__ import annotations

from pdserve.scheduler.fsm import Resources
from pdserve.scheduler.plan import Plan, PrefillOp
from pdserve.scheduler.request import Request
from pdserve.scheduler.round.waiting import WaitFacts


class PlanBuild:
    __slots__ = ("plan", "budget", "batch_left", "sealed", "new_prompts_sealed",
                 "capacity_blocker", "admission_failed", "prefill_progressed",
                 "decodes_use_budget", "prefill_may_join", "waits")

    def __init__(self, plan: Plan, budget: int, batch: int, decodes_use_budget: bool,
                 mixed: bool, waits: WaitFacts | None = None):
        self.plan = plan
        self.budget = budget
        self.batch_left = batch
        self.sealed = False              # an incomplete prefill holds the line (§1.1)
        self.new_prompts_sealed = False  # a waiting readmission holds new prompts (§4)
        self.capacity_blocker: Request | None = None   # first request whose admission failed
        self.admission_failed = False
        self.prefill_progressed = False
        self.decodes_use_budget = decodes_use_budget
        self.prefill_may_join = mixed    # non-mixed: no prefill beside decodes
        self.waits = waits if waits is not None else WaitFacts()   # why the rest wait

    def fail(self, req) -> None:
        self.admission_failed = True
        if self.capacity_blocker is None:
            self.capacity_blocker = req

    def can_prefill(self) -> bool:
        if self.budget <= 0 or self.batch_left <= 0:
            return False
        return self.prefill_may_join or not self.plan.decodes

    def can_decode(self) -> bool:
        if self.batch_left <= 0 or (self.decodes_use_budget and self.budget <= 0):
            return False
        return self.prefill_may_join or not self.plan.prefills

    def push_decode(self, req, res: Resources) -> None:
        self.plan.decodes.append(req)
        self.batch_left -= 1
        if self.decodes_use_budget:
            self.budget -= 1
        res.forwards_out += 1

    def push_prefill(self, op: PrefillOp, res: Resources) -> None:
        self.plan.prefills.append(op)
        self.budget -= op.tokens + op.replay
        self.batch_left -= 1
        self.prefill_progressed = True
        res.forwards_out += 1
