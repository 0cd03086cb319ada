"""The simulated executor: carries out a plan by advancing a virtual clock.

It produces deterministic token ids and stops each request after the number
of tokens its trace says the model generates, so the planner sees exactly
what a real executor would report, at simulated speed.
"""

from __future__ import annotations

from pdserve.roles.cost_model import CostModel
from pdserve.scheduler.plan import Plan, StepResult


class SimExecutor:
    def __init__(self, cost: CostModel, vocab_size: int = 32000):
        self.cost = cost
        self.vocab_size = vocab_size
        self.now = 0.0
        self._stop_after: dict[str, int] = {}

    def expect(self, req_id: str, output_tokens: int | None) -> None:
        """The simulated model ends `req_id` after `output_tokens` tokens
        (None: it never stops by itself; max_new_tokens ends it)."""
        if output_tokens is not None:
            self._stop_after[req_id] = output_tokens

    def forget(self, req_id: str) -> None:
        self._stop_after.pop(req_id, None)

    def _token(self, req) -> int:
        return (req.seq * 7919 + len(req.output) * 104729) % self.vocab_size

    def run(self, plan: Plan) -> StepResult:
        ctx = 0
        for req in plan.decodes:
            ctx += req.num_tokens
        self.now += self.cost.round_seconds(
            [(op.begin - op.replay, op.tokens + op.replay) for op in plan.prefills],
            ctx, len(plan.decodes))
        stop_after = self._stop_after
        result = StepResult()
        stopped = result.stopped
        for op in plan.prefills:
            if op.completes:
                req = op.req
                result.prefill_tokens.append(self._token(req))
                if stop_after.get(req.id, -1) == len(req.output) + 1:
                    stopped.add(req)
            else:
                result.prefill_tokens.append(None)
        vocab = self.vocab_size
        toks = result.decode_tokens
        for req in plan.decodes:
            n = len(req.output)
            toks.append((req.seq * 7919 + n * 104729) % vocab)
            if stop_after.get(req.id, -1) == n + 1:
                stopped.add(req)
        return result
