"""Speculative decoding on the executor's side: who proposes, what a verify
row samples, and what acceptance has been.

After a round lands, every request that sampled a token and may speculate
asks the proposer (kernels/proposers.py) for up to k candidates; they go
back in the round's result (`StepResult.drafts`), the planner keeps them on
the request and the next decode carries them (`Plan.verify`, at most as
many as its budget and generation allow). That decode's 1 + k rows are
verified by kernels/rejection.py, and the executor takes the accepted
tokens one by one, as if each had been a decode of its own (a stop among
them ends the request there).

A request speculates unless its sampling reads its own history token by
token where a verify does not pass it (repetition, frequency and presence
penalties, a logit bias), asks for logprobs, or is still short of
min_tokens: those decode one token a round as before.

The gate (spec_gate.py) may turn proposing off for a while; nothing else
changes then. Counters carry vLLM's names where the meaning is the same
(router/metrics.py): drafts, draft tokens, accepted tokens, and accepted
tokens per candidate position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kernels.proposers import DraftAsk, NgramProposer, Proposer
from pdserve.kernels.rejection import VerifyRow
from pdserve.kernels.sampling import SamplingParams
from pdserve.roles.spec_gate import SpecGate
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
    if spec.method is SpecMethod.NGRAM:
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    raise ValueError(f"speculative method {spec.method.value} has no proposer in this build")


class Speculation:
    """One executor's speculation: its proposer, gate and counters."""

    def __init__(self, spec: SpecConfig, proposer: Proposer | None = None,
                 gate: SpecGate | None = None):
        self.cfg = spec
        self.k = spec.k
        self.proposer = proposer if proposer is not None else build_proposer(spec)
        self.gate = gate if gate is not None else (SpecGate(spec.k) if spec.gate else None)
        self.counts = SpecCounts(spec.k)

    @property
    def proposing(self) -> bool:
        return self.gate is None or self.gate.on

    def propose(self, asks: list[DraftAsk]) -> dict:
        """Request id -> its candidates (only those that got any)."""
        if not asks or not self.proposing:
            return {}
        out = {}
        for ask, d in zip(asks, self.proposer.propose(asks)):
            if d.tokens:
                out[ask.req_id] = list(d.tokens[:ask.k])
        return out

    def rows(self, verifies: list, tracked: dict) -> list[VerifyRow]:
        """The rejection sampler's view of this round's verify rows:
        `verifies` are (request, candidates) in logit order."""
        out = []
        for req, drafts in verifies:
            t = tracked[req.id]
            seed = t.params.seed if t.params.seed is not None else t.seed
            out.append(VerifyRow(list(drafts), t.params, seed, len(req.output) + t.prior))
        return out

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
