"""One engine: a planner, an executor, and the loop between them.

    plan = planner.build()       # pure, deterministic, no clock
    result = executor.run(plan)  # torch forward, or simulated time
    planner.apply(plan, result)  # tokens, finishes, releases

The same class serves every role and every executor.

With `engine.overlap` (fused and D, an executor with `launch` / `wait`),
the round is pipelined in a fixed order, so plans stay deterministic:

    build(N+1)                   # while N's forward runs
    result = executor.wait(N)
    apply(N)                     # overlap.apply: ends land one round late
    executor.launch(N+1)

Each `step()` still applies exactly one plan and returns its outcome. P never
runs ahead: it has no decodes, and a prompt it ships needs its token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.grammar import grammar_holds
from pdserve.scheduler.round import overlap
from pdserve.scheduler.plan import Plan
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.request import Request


@dataclass
class StepOutcome:
    plan: Plan
    finished: list = field(default_factory=list)
    failed: list = field(default_factory=list)   # aborted because the round failed
    error: str = ""
    invalid: bool = False   # `failed` failed on their own input (a grammar), not the engine
    # engine.overlap: requests whose abort waited for their forward and took
    # effect this round (what Engine.abort deferred)
    aborted: list = field(default_factory=list)


class Engine:
    def __init__(self, name: str, planner: Planner, executor, forget_finished: bool = True):
        """`forget_finished=False`: the owner reads a finished request's
        executor state (its text) after the round, then forgets it itself."""
        self.name = name
        self.planner = planner
        self.executor = executor
        self.forget_finished = forget_finished
        self.overlap = (planner.cfg.overlap and planner.decodes_locally
                        and hasattr(executor, "launch"))
        # (plan, the executor's handle): launched, not applied
        self._in_flight: tuple[Plan, Any] | None = None
        # (plan, error): a launch that failed, reported by the next step
        self._launch_error: tuple[Plan, str] | None = None

    @property
    def role(self) -> str:
        return self.planner.role.value

    def submit(self, req: Request, output_tokens: int | None = None) -> None:
        self.planner.submit(req)
        expect = getattr(self.executor, "expect", None)
        if expect is not None:
            expect(req.id, output_tokens)

    def has_work(self) -> bool:
        return self._in_flight is not None or self._launch_error is not None \
            or self.planner.has_work()

    def abort(self, req_id: str, reason: str):
        """Abort `req_id`: now (returns the Request), or, with a forward of
        its own in flight, once it lands (returns None; the step that
        releases it lists it in `StepOutcome.aborted`)."""
        if self.overlap:
            return overlap.end_after_forward(self.planner, req_id, reason)
        return self.planner.abort(req_id, reason)

    def step(self) -> StepOutcome | None:
        """One round. None when the planner built nothing. With a disk
        tier, its probes and reads land first; a round that would be empty
        only because prefetches hold their requests waits for a read."""
        spec = getattr(self.executor, "spec", None)
        if spec is not None:        # the gate's side for the rounds built now
            self.planner.speculating = spec.proposing
        refused = self._grammars()
        if refused is not None:
            return refused
        if self.overlap:
            return self._step_ahead()
        plan = self._build_with_disk(getattr(self.executor, "disk", None))
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

    # ---- structured outputs ----------------------------------------------------------
    def _grammars(self) -> StepOutcome | None:
        """Requests whose grammar still compiles wait (Hold.GRAMMAR); ready
        ones are admitted from this round on. A compile that failed or ran
        out of time fails its requests: an outcome of its own, no round."""
        gone, why = grammar_holds(self.planner, self.executor)
        if not gone:
            return None
        return StepOutcome(Plan(self.planner.round), failed=gone, error=why,
                           invalid=True)

    # ---- engine.overlap ----------------------------------------------------------
    def _build_with_disk(self, disk):
        """A plan, the disk tier's probes and reads landed first; one that
        would be empty only because prefetches hold their requests waits
        for a read."""
        if disk is not None:
            disk.before_build(self.planner)
        plan = self.planner.build()
        while plan.is_empty() and disk is not None and disk.holding():
            disk.wait_progress(0.05)
            disk.before_build(self.planner)
            plan = self.planner.build()
        return plan

    def _step_ahead(self) -> StepOutcome | None:
        p, ex = self.planner, self.executor
        if self._launch_error is not None:
            (plan, reason), self._launch_error = self._launch_error, None
            return StepOutcome(plan, failed=overlap.fail_plans(p, [plan], reason), error=reason)
        disk = getattr(ex, "disk", None)
        if self._in_flight is None:
            plan = self._build_with_disk(disk)
            if plan.is_empty():
                return None
            try:
                self._in_flight = (plan, ex.launch(plan))
            except Exception as e:
                reason = _reason(e)
                return StepOutcome(plan, failed=overlap.fail_plans(p, [plan], reason),
                                   error=reason)
        (plan, handle), self._in_flight = self._in_flight, None
        if disk is not None:                 # N's disk reads ran at its launch
            disk.before_build(p)
        built = p.build()                    # round N+1, while N's forward runs
        nxt = None if built.is_empty() else built
        try:
            result = ex.wait(handle)
        except Exception as e:               # N is lost, and N+1 was built on it
            reason = _reason(e)
            return StepOutcome(plan, failed=overlap.fail_plans(p, [plan, nxt], reason),
                               error=reason)
        finished, aborted = overlap.apply(p, plan, result)
        if nxt is not None:
            try:
                self._in_flight = (nxt, ex.launch(nxt))
            except Exception as e:           # N landed; N+1 fails on the next step
                self._launch_error = (nxt, _reason(e))
        forget = getattr(ex, "forget", None)
        if forget is not None and self.forget_finished:
            for req in finished + aborted:
                forget(req.id)
        return StepOutcome(plan, finished, aborted=aborted)


def _reason(e: Exception) -> str:
    return f"engine error: {type(e).__name__}: {e}"
