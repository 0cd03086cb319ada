"""The simulated executor: carries out a plan by advancing a virtual clock.

It produces deterministic token ids and stops each request after the number
of tokens its trace says the model generates, so the planner sees exactly
what a real executor would report, at simulated speed. Host copies finish
within the round: stream-ordered snapshot stores and loads sit on the
forward's critical path and cost PCIe time; pinned publication stores run
on their own stream and cost the forward nothing.
"""

from __future__ import annotations

from pdserve.roles.cost_model import CostModel
from pdserve.scheduler.plan import Plan, StepResult


class SimExecutor:
    def __init__(self, cost: CostModel, page_size: int, vocab_size: int = 32000):
        self.cost = cost
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.now = 0.0
        self._stop_after: dict[str, int] = {}

    def expect(self, req_id: str, output_tokens: int | None) -> None:
        """The simulated model ends `req_id` after `output_tokens` tokens
        (None: it never stops by itself; max_new_tokens ends it)."""
        if output_tokens is not None:
            self._stop_after[req_id] = output_tokens

    def stops_at(self, req_id: str, n: int) -> bool:
        """Does the simulated model stop at its n-th generated token?"""
        return self._stop_after.get(req_id, -1) == n

    def forget(self, req_id: str) -> None:
        self._stop_after.pop(req_id, None)

    def run(self, plan: Plan) -> StepResult:
        ctx = 0
        for req in plan.decodes:
            ctx += req.num_tokens
        copied = sum(len(s.device_pages) for s in plan.stores if not s.pinned)
        copied += sum(len(ld.device_pages) for ld in plan.loads)
        self.now += self.cost.round_seconds(
            [(op.begin - op.replay, op.tokens + op.replay) for op in plan.prefills],
            ctx, len(plan.decodes)) + self.cost.copy_seconds(copied * self.page_size)
        stop_after = self._stop_after
        vocab = self.vocab_size
        result = StepResult(stores_done=[s.id for s in plan.stores],
                            loads_done=[ld.id for ld in plan.loads])
        stopped = result.stopped
        for op in plan.prefills:
            if op.completes:
                req = op.req
                n = len(req.output)
                result.prefill_tokens.append((req.seq * 7919 + n * 104729) % vocab)
                if stop_after.get(req.id, -1) == n + 1:
                    stopped.add(req)
            else:
                result.prefill_tokens.append(None)
        toks = result.decode_tokens
        for req in plan.decodes:
            n = len(req.output)
            toks.append((req.seq * 7919 + n * 104729) % vocab)
            if stop_after.get(req.id, -1) == n + 1:
                stopped.add(req)
        return result
