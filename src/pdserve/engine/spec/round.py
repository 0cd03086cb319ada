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

import dataclasses
from dataclasses import dataclass, field

from pdserve.kernels.spec.proposers import DraftAsk


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
    from pdserve.engine.spec.speculation import speculates

    return (not req.output or req.remaining_new_tokens - len(new) > 1) and \
        speculates(tracked.params, len(req.output) + len(new))


@dataclass(frozen=True)
class RoundRows:
    """Where a request's rows of one round began, and its block tables as
    the round was staged (a proposer keeping K/V, a draft model, writes
    the same slots after the round lands)."""
    start: int
    tables: tuple       # per page group (the executor's `kv`)
    end: int | None = None      # a prefill chunk's end; None: a decode's, known once it lands


def round_rows(plan, kv: list[int], copy: bool) -> dict[str, RoundRows]:
    """Request id -> its RoundRows, for every request `plan` runs. `copy`:
    copy the tables, which the next round's build may change before this
    round lands (engine.overlap)."""
    def tables(req):
        t = req.state.res.tables
        return tuple(list(t[g]) if copy else t[g] for g in kv)
    out = {op.req.id: RoundRows(op.begin, tables(op.req), op.begin + op.tokens)
           for op in plan.prefills}
    for req in plan.decodes:
        out[req.id] = RoundRows(req.num_tokens - 1, tables(req))
    return out


def keep_up_asks(plan, landed: dict, asks: list[DraftAsk], rows: dict[str, RoundRows],
                 groups: tuple, skip: set) -> list[DraftAsk]:
    """Every request of the round as a proposer keeping K/V sees it: the
    `asks` (requests that may carry candidates), each with where its rows
    began and its tables in the proposer's `groups`, and a k = 0 ask for
    every other request the round ran (its context cut where the target's
    K/V now end), so the proposer's K/V keep up with the target's.
    `landed`: request id -> the tokens the round gave it (a completing
    prefill, a decode, a verify, a stop among them); `skip`: requests whose
    rows are dropped (a disk read that missed)."""
    asking = {a.req_id: a for a in asks}
    out = []
    for req in [op.req for op in plan.prefills] + list(plan.decodes):
        if req.id in skip:
            continue
        f = rows[req.id]
        tables = tuple(f.tables[g] for g in groups)
        a = asking.get(req.id)
        if a is not None:
            out.append(dataclasses.replace(a, start=f.start, tables=tables))
            continue
        context = req.prompt.tokens + req.output + landed.get(req.id, [])
        end = f.end
        if end is None:                 # a decode: its input, and what a verify kept
            end = f.start + len(landed.get(req.id, ()))
        out.append(DraftAsk(req.id, context[:end], 0, start=f.start, tables=tables))
    return out
