"""A P engine and a D engine in one process, their handoff done by hand:
D's remote prefill becomes P's request, P's shipped pages are copied into
D's landing pages (what a transport writes), and its first token and
speculative candidates land on D as the notification would carry them.
No gRPC, no transport, no thread: what tests and `pdserve bench spec` use
to hold a P/D pair's tokens and acceptance against a fused engine's."""

from __future__ import annotations

import torch

from pdserve.text.sampling_params import SamplingParams
from pdserve.engine.grammar import grammar_holds
from pdserve.engine.executor.torch_executor import TorchExecutor
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.request import Request, SamplingLimits


class LocalPair:
    def __init__(self, model, tokenizer, cfg: EngineConfig):
        self.px = TorchExecutor(model, tokenizer, cfg, detokenize=False)
        self.dx = TorchExecutor(model, tokenizer, cfg, detokenize=False)
        self.P = Planner(cfg, Role.PREFILL, groups=self.px.groups)
        self.D = Planner(cfg, Role.DECODE, groups=self.dx.groups)
        self._landing: dict = {}
        self._params: dict = {}
        self.shipped_drafts = 0        # candidates P shipped with first tokens
        self.first_pages: list = []    # each remote prefill's first page (D's prefix hit)
        self.landed: list = []         # (request id, candidates) landed on D, oldest first
        self._seq = 0

    def submit(self, prompt, sp: SamplingParams) -> Request:
        self._seq += 1
        r = Request(f"pair-{self._seq}", prompt, SamplingLimits(sp.max_tokens))
        self.dx.register(r.id, sp, fallback_seed=self._seq, prompt=prompt)
        self._params[r.id] = (sp, self._seq)
        self.D.submit(r)
        return r

    def has_work(self) -> bool:
        return self.D.has_work() or self.P.has_work()

    def generate(self, prompts, sp: SamplingParams) -> list:
        reqs = [self.submit(p, sp) for p in prompts]
        while self.has_work():
            self.tick()
        return [r.output for r in reqs]

    def tick(self) -> list:
        """One D round, one P round, then the handoffs; D's finished requests."""
        finished = []
        self._grammars(self.D, self.dx)
        dplan = self.D.build()
        for op in dplan.remote_prefills:
            r = op.req
            twin = Request(r.id, r.prompt, SamplingLimits(max_new_tokens=1))
            twin.first_page = op.first_page
            self.first_pages.append(op.first_page)
            self._landing[r.id] = op.landing
            sp, seed = self._params[r.id]
            self.px.register(r.id, sp, fallback_seed=seed, prompt=r.prompt.tokens)
            self.P.submit(twin)
        if not dplan.is_empty():
            finished += self._finished(self.D.apply(dplan, self.dx.run(dplan)))
        self._grammars(self.P, self.px)
        pplan = self.P.build()
        if not pplan.is_empty():
            self.P.apply(pplan, self.px.run(pplan))
        for op in pplan.remote_decodes:
            finished += self._land(op)
        return finished

    def _land(self, op) -> list:
        landing = self._landing.pop(op.req.id)
        for g, (src, dst) in enumerate(zip(op.src, landing)):
            if len(src) != len(dst):
                raise RuntimeError(f"{op.req.id}: P ships {len(src)} pages of group {g} where "
                                   f"D's landing has {len(dst)}")
            p_pool, d_pool = self.px.caches[g].data, self.dx.caches[g].data
            d_pool[torch.tensor(dst, dtype=torch.long)] = \
                p_pool[torch.tensor(src, dtype=torch.long)]
        self.shipped_drafts += len(op.drafts)
        self.landed.append((op.req.id, list(op.drafts)))
        req = self.D.requests[op.req.id]
        stopped = self.dx.on_token(req, op.first_token)
        done = self._finished(self.D.transfer_landed(op.req.id, op.first_token, stopped,
                                                     op.drafts))
        self.P.peer_ack(op.req.id)
        self.px.forget(op.req.id)
        return done

    @staticmethod
    def _grammars(planner, executor) -> None:
        """Constrained requests wait for their grammars (an engine's step does
        this); one whose compile fails here is a test's error."""
        gone, why = grammar_holds(planner, executor, idle_wait_s=0)  # the other side may run
        if gone:
            raise RuntimeError(f"{[r.id for r in gone]}: {why}")

    def _finished(self, reqs) -> list:
        for r in reqs:
            self.dx.forget(r.id)
            self._params.pop(r.id, None)
        return list(reqs)
