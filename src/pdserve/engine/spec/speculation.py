"""Speculative decoding on the executor's side: who proposes, what a verify
row samples, and what acceptance has been.

After a round lands, every request that sampled a token and may speculate
asks the proposer (kernels/spec/proposers.py) for up to k candidates; they go
back in the round's result (`StepResult.drafts`), the planner keeps them on
the request and the next decode carries them (`Plan.verify`, at most as
many as its budget and generation allow). That decode's 1 + k rows are
verified by kernels/spec/rejection.py, and the executor takes the accepted
tokens one by one, as if each had been a decode of its own (a stop among
them ends the request there).

A request speculates unless its sampling reads its own history token by
token where a verify does not pass it (repetition, frequency and presence
penalties, a logit bias), asks for logprobs, or is still short of
min_tokens: those decode one token a round as before.

A draft model (spec_draft.py, kernels/spec/draft_model.py) that sampled its
candidates gives its q with them; it is kept here by request until the
verify that carries them, and handed to the rejection sampler.

The gate (spec_gate.py) may turn proposing off for a while; nothing else
changes then. Counters carry vLLM's names where the meaning is the same
(router/metrics.py): drafts, draft tokens, accepted tokens, and accepted
tokens per candidate position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pdserve.kernels.spec.proposers import DraftAsk, NgramProposer, Proposer
from pdserve.kernels.spec.rejection import VerifyRow
from pdserve.text.sampling_params import SamplingParams
from pdserve.engine.spec.gate import SpecGate
from pdserve.scheduler.speculation import SpecConfig, SpecMethod


@dataclass
class SpecCounts:
    """Monotonic, since the engine started."""
    k: int
    drafts: int = 0             # verifies run (vLLM: num_drafts)
    draft_tokens: int = 0       # candidates they carried
    accepted_tokens: int = 0    # candidates accepted
    # accepted at candidate position i (0-based), over all verifies
    accepted_per_pos: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.k

    def verified(self, carried: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += carried
        self.accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify gives on average (accepted candidates and the
        one more every verify gives); 0 before the first."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0


def speculates(params: SamplingParams, generated: int) -> bool:
    """Whether a request sampling by `params`, `generated` tokens in, may
    carry candidates (the module's note says why some may not)."""
    return not params.penalizes and params.logprobs is None and generated >= params.min_tokens


def build_proposer(spec: SpecConfig) -> Proposer:
    """The proposer `spec` names that needs no model (a draft model is
    loaded by the executor, whose pages hold its K/V: engine/spec/draft.py)."""
    if spec.method is SpecMethod.NGRAM:
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    raise ValueError(f"speculative method {spec.method.value} needs its model loaded beside "
                     "the target's (TorchExecutor)")


def _fed_context(a: DraftAsk):
    """An ask's context as a k = 0 ask gives it: without the token just
    sampled, whose K/V the target has not computed (k = 0 asks already are)."""
    return a.context[:-1] if a.k >= 1 else a.context


class Speculation:
    """One executor's speculation: its proposer, gate and counters."""

    def __init__(self, spec: SpecConfig, proposer: Proposer | None = None,
                 gate: SpecGate | None = None):
        self.cfg = spec
        self.k = spec.k
        self.proposer = proposer if proposer is not None else build_proposer(spec)
        # a sampling drafter's q for the candidates it gave each request last
        # (kernels/spec/rejection.py's min(1, p/q)); a request absent here, or whose
        # verify carries other candidates (P's, landed on D), is verified as a
        # point mass, which is exact whatever drew the candidates
        self.q: dict[str, tuple[list, torch.Tensor]] = {}
        self.gate = gate if gate is not None else (SpecGate(spec.k) if spec.gate else None)
        self.counts = SpecCounts(spec.k)

    @property
    def proposing(self) -> bool:
        return self.gate is None or self.gate.on

    def propose(self, asks: list[DraftAsk]) -> dict:
        """Request id -> its candidates (only those that got any). While the
        gate has proposing off, a proposer keeping K/V is still asked, for
        none (k = 0): its K/V must keep up with the target's."""
        if not asks:
            return {}
        if not self.proposing:
            if self.proposer.keeps_kv:
                self.proposer.propose([dataclasses.replace(a, k=0, context=_fed_context(a))
                                       for a in asks])
            return {}
        out = {}
        for ask, d in zip(asks, self.proposer.propose(asks)):
            self.q.pop(ask.req_id, None)
            if d.tokens:
                out[ask.req_id] = list(d.tokens[:ask.k])
                if isinstance(d.probs, torch.Tensor):
                    self.q[ask.req_id] = (out[ask.req_id], d.probs)
        return out

    def rows(self, verifies: list, tracked: dict) -> list[VerifyRow]:
        """The rejection sampler's view of this round's verify rows:
        `verifies` are (request, candidates) in logit order."""
        out = []
        for req, drafts in verifies:
            t = tracked[req.id]
            seed = t.params.seed if t.params.seed is not None else t.seed
            out.append(VerifyRow(list(drafts), t.params, seed, len(req.output) + t.prior,
                                 self._q_for(req.id, list(drafts))))
        return out

    def _q_for(self, req_id: str, drafts: list):
        """The drafter's q for `drafts` if it drew them (the planner may have
        cut them short: q's first rows then), else None."""
        kept = self.q.get(req_id)
        if kept is None or kept[0][:len(drafts)] != drafts:
            return None
        return kept[1][:len(drafts)]

    def round_done(self, plan, result, seconds: float, cpu_seconds: float | None = None) -> None:
        """A round's measurement for the gate: decode-only rounds, their
        delivered tokens (every token the decodes gave) in `seconds` of
        wall time and `cpu_seconds` of this process's CPU time."""
        if self.gate is None or plan.prefills or not plan.decodes:
            return
        tokens = len(result.decode_tokens) + sum(len(v) for v in result.decode_more.values())
        self.gate.observe(bool(plan.verify), len(plan.decodes), tokens, seconds, cpu_seconds,
                          self.counts.mean_acceptance_length)

    def forget(self, req_id: str) -> None:
        self.proposer.forget(req_id)
        self.q.pop(req_id, None)


def spec_line(cfg) -> str:
    """An engine's speculative settings in one line, as the P/D handshake
    compares them ("off": it does not speculate)."""
    return cfg.speculative.describe() if cfg.speculative is not None else "off"


def check_peer_spec(own_name: str, cfg, r) -> None:
    """A peer introduced with other speculative settings is refused when the
    two meet, not at its first request: P drafts by its settings and D
    verifies by its own. `r`: the AddPeerRequest."""
    from pdserve.scheduler.planner import RejectedRequest

    own, theirs = spec_line(cfg), r.spec_config or "off"
    if own != theirs:
        raise RejectedRequest(f"{own_name} and its peer {r.engine} speculate differently: "
                              f"{own_name} has speculative {own}, {r.engine} has {theirs}; give "
                              "both roles the same speculative settings")
