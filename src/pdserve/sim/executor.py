"""The simulated executor: carries out a plan by advancing a virtual clock.

It produces deterministic token ids and stops each request after the number
of tokens its trace says the model generates, so the planner sees exactly
what a real executor would report, at simulated speed. Host copies run
within the round: stream-ordered snapshot stores and loads sit on the
forward's critical path and cost PCIe time; pinned publication stores run
on their own stream and cost the forward nothing. Their acks come back
with the round, or `ack_delay_rounds` rounds after it, as an executor with
asynchronous copies reports them (an idle round, `idle_round`, counts). A copied page costs the
bytes of its cache group's page (`group_page_bytes`; a state group's page
is one state slot). A profile measured on a shared host corrects each
round by its kind, decode batch and the other engines computing when it
starts (`neighbours`, which the simulation sets): `Profile.factor`.
"""

from __future__ import annotations

from collections import deque

from pdserve.sim.cost.roofline import CostModel
from pdserve.sim.disk import SimDiskEdge
from pdserve.sim.lora import SimLora
from pdserve.scheduler.plan import Plan, StepResult


class SimExecutor:
    def __init__(self, cost: CostModel, page_size: int, vocab_size: int = 32000,
                 group_page_bytes: list[int] | None = None, ack_delay_rounds: int = 0):
        """`group_page_bytes`: bytes of one page of each of the planner's
        cache groups (None: one group of every layer). `ack_delay_rounds`:
        rounds after its plan that a copy's ack is reported (0: in it)."""
        self.cost = cost
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.group_page_bytes = group_page_bytes or \
            [cost.model.kv_bytes_per_token * page_size]
        self._window = cost.window
        self.now = 0.0
        self.neighbours = 0           # other engines computing as this round starts
        self._stop_after: dict[str, int] = {}
        self.ack_delay_rounds = ack_delay_rounds
        self.rounds = 0               # rounds run, idle ones included
        self._acks: deque = deque()   # (due round, store ids, load ids), in due order
        self.disk: SimDiskEdge | None = None    # the engine's disk tier edge, if any
        self.lora: SimLora | None = None        # LoRA adapters' cost (sim/lora.py), if any

    def acks_pending(self) -> bool:
        return bool(self._acks)

    def _due_acks(self, result: StepResult) -> StepResult:
        acks = self._acks
        while acks and acks[0][0] <= self.rounds:
            _, stores, loads = acks.popleft()
            result.stores_done.extend(stores)
            result.loads_done.extend(loads)
        return result

    def idle_round(self) -> StepResult:
        """A round with nothing to run: it reports the acks that fall due."""
        self.rounds += 1
        return self._due_acks(StepResult())

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

    def _copy_seconds(self, plan: Plan) -> float:
        if not plan.stores and not plan.loads:
            return 0.0
        copied = [0] * len(self.group_page_bytes)
        for s in plan.stores:
            if not s.pinned:
                copied[s.group] += len(s.device_pages)
        for ld in plan.loads:
            copied[ld.group] += len(ld.device_pages)
        ps = self.page_size
        return sum(self.cost.copy_seconds(n * ps, b / ps)  # type: ignore[arg-type, misc]
                   for n, b in zip(copied, self.group_page_bytes) if n)

    def run(self, plan: Plan) -> StepResult:
        ctx = wctx = 0
        w = self._window
        if w:
            for req in plan.decodes:
                n = req.num_tokens
                ctx += n
                wctx += n if n < w else w
        else:
            for req in plan.decodes:
                ctx += req.num_tokens
        compute = self.cost.round_seconds(
            [(op.begin - op.replay, op.tokens + op.replay) for op in plan.prefills],
            ctx, len(plan.decodes), wctx)
        compute *= self.cost.round_factor(bool(plan.prefills), len(plan.decodes),
                                          self.neighbours)
        disk_result = StepResult()
        disk_s = 0.0
        if self.disk is not None:
            self.disk.write_through(plan)
            disk_s = self.disk.read_seconds(plan, disk_result)
        if self.lora is not None:
            compute += self.lora.round_seconds(plan)
        self.now += compute + self._copy_seconds(plan) + disk_s
        stop_after = self._stop_after
        vocab = self.vocab_size
        self.rounds += 1
        if self.ack_delay_rounds:
            if plan.stores or plan.loads:
                self._acks.append((self.rounds + self.ack_delay_rounds,
                                   [s.id for s in plan.stores], [ld.id for ld in plan.loads]))
            result = self._due_acks(StepResult())
        else:
            result = StepResult(stores_done=[s.id for s in plan.stores],
                                loads_done=[ld.id for ld in plan.loads])
        result.disk_loads_done = disk_result.disk_loads_done     # in their round, always
        result.disk_loads_missed = disk_result.disk_loads_missed
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

    # ---- engine.overlap: the same rounds, launched and waited for ----------------
    def launch(self, plan: Plan) -> Plan:
        """A simulated round is computed when it is waited for, after the
        round before it has applied, as the real forward thread would have
        it; the simulated clock does not model the host time overlap hides."""
        return plan

    def wait(self, plan: Plan) -> StepResult:
        return self.run(plan)
