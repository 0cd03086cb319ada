"""One round's speculative verify rows, as the executor stages, samples and
lands them (speculation.py has the why).

A verify row is a decode of 1 + d positions: the request's last token at
position num_tokens - 1 and its d candidates behind it, written into the
pages the planner admitted for them. In the forward's flat batch verify rows
sit after the prefill chunks and before the plain decodes (attention
batches the trailing one-token rows together), and their 1 + d logit rows
come after every other sampling row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kernels.proposers import DraftAsk


@dataclass
class SpecRound:
    verifies: list              # (request, candidates), in logit order
    rows: list                  # kernels.rejection.VerifyRow per verify
    tokens: list = field(default_factory=list)   # per verify, the tokens it gave (once run)

    def by_request(self) -> dict:
        return {req.id: toks for (req, _), toks in zip(self.verifies, self.tokens)}

    def drafts_of(self, req_id: str) -> list:
        return next(d for r, d in self.verifies if r.id == req_id)


def check_speculation(model, groups) -> None:
    """Refuse speculation, by the model family's name, where a verify could
    not be undone: a state group (Gated DeltaNet, short conv) keeps one
    state per sequence, which the rejected candidates would have advanced;
    restoring the last accepted position's state is not built yet."""
    if any(g.state for g in groups):
        family = getattr(model.cfg, "arch", None) or type(model).__name__
        raise ValueError(f"engine.speculative: {family} keeps a recurrent state per sequence "
                         "(a state cache group), which a rejected candidate would leave "
                         "advanced, and restoring it at the last accepted token is not built "
                         "yet; leave engine.speculative out for this model")


def draft_ask(req, new: list, k: int, tracked=None) -> DraftAsk:
    """The proposer's question for `req` after this round's `new` tokens;
    `tracked` (the executor's Tracked): how it samples, for a drafter that
    draws its candidates as the target would, keyed as the verify's draws."""
    if tracked is None:
        return DraftAsk(req.id, req.prompt.tokens + req.output + new, k)
    sp = tracked.params
    seed = sp.seed if sp.seed is not None else tracked.seed
    return DraftAsk(req.id, req.prompt.tokens + req.output + new, k, sp, seed,
                    len(req.output) + len(new) + tracked.prior)


def speculates_now(tracked, req, new: list) -> bool:
    """Whether `req` may carry candidates after this round
    (speculation.speculates), and has room for one beside the next verify's
    own token (else proposing, a draft model's k forwards, is wasted). A
    first token is always proposed after: on P the request's limit is its
    twin's one token, and D verifies what P ships."""
    from pdserve.roles.speculation import speculates

    return (not req.output or req.remaining_new_tokens - len(new) > 1) and \
        speculates(tracked.params, len(req.output) + len(new))
