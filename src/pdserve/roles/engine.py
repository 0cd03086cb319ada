"""One engine: a planner, an executor, and the loop between them.

    plan = planner.build()       # pure, deterministic, no clock
    result = executor.run(plan)  # torch forward, or simulated time
    planner.apply(plan, result)  # tokens, finishes, releases

The same class serves every role and every executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.scheduler.plan import Plan
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.request import Request


@dataclass
class StepOutcome:
    plan: Plan
    finished: list = field(default_factory=list)
    failed: list = field(default_factory=list)   # aborted because the round failed
    error: str = ""


class Engine:
    def __init__(self, name: str, planner: Planner, executor, forget_finished: bool = True):
        """`forget_finished=False`: the owner reads a finished request's
        executor state (its text) after the round, then forgets it itself."""
        self.name = name
        self.planner = planner
        self.executor = executor
        self.forget_finished = forget_finished

    @property
    def role(self) -> str:
        return self.planner.role.value

    def submit(self, req: Request, output_tokens: int | None = None) -> None:
        self.planner.submit(req)
        expect = getattr(self.executor, "expect", None)
        if expect is not None:
            expect(req.id, output_tokens)

    def has_work(self) -> bool:
        return self.planner.has_work()

    def step(self) -> StepOutcome | None:
        """One round. None when the planner built nothing."""
        plan = self.planner.build()
        if plan.is_empty():
            return None
        try:
            result = self.executor.run(plan)
        except Exception as e:               # the round is lost; its requests fail cleanly
            reason = f"engine error: {type(e).__name__}: {e}"
            return StepOutcome(plan, failed=self.planner.fail_plan(plan, reason), error=reason)
        finished = self.planner.apply(plan, result)
        forget = getattr(self.executor, "forget", None)
        if forget is not None and self.forget_finished:
            for req in finished:
                forget(req.id)
        return StepOutcome(plan, finished)
