"""Why each waiting request waits: an operator's query over the last round.

While `build()` runs, the phases note a few facts where they stop: the rule
that stopped the waiting line and the request it stopped at, the
readmission the round tried, and why retraction could not help. That is a
handful of writes a round, none per waiting request. `wait_reasons` turns
them into one `WaitReason` per request that is not running, lazily, when an
operator asks. FIFO does the rest: nobody overtakes the request a phase
stopped at, so every request behind it waits by the same rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.scheduler.fsm import Retracted
from pdserve.scheduler.plan import Plan
from pdserve.scheduler.plan_state import PlannerState


class Hold(enum.StrEnum):
    """The rule that held a request in the last round. A StrEnum: each
    member compares equal to its value, which is stable for dashboards."""

    BEHIND_INCOMPLETE_PREFILL = "behind_incomplete_prefill"  # §1.1
    BUDGET = "budget"                                  # token budget or batch slots ran out
    CAPACITY = "capacity"                              # its admission failed for pages
    SLIDING_ROOM = "sliding_room"                      # a sliding pool's residents may still grow
    READMISSION_SEAL = "readmission_seal"              # §4: new prompts sealed behind it
    DECODE_ROUND = "decode_round"                      # non-mixed: decodes hold the round
    RETRACTION_GRANT = "retraction_grant"              # §2: the freed room went to one request
    READMISSION_LIMIT = "readmission_limit"            # §4: one readmission a round
    RETRACTED = "retracted"                            # §2: a victim of this round
    YIELDS = "yields"                                  # §2: a victim yields to whom it freed pages for
    LOCAL_RECOVERY = "local_recovery"                  # D: a recovery claims the round
    WAITING_FOR_PREFILL = "waiting_for_prefill"        # D: a P engine prefills it
    REMOTE_ADMISSION_LIMIT = "remote_admission_limit"  # D: one remote admission a round
    NOT_YET_PLANNED = "not_yet_planned"                # arrived after the last build
    ADAPTER_SLOT = "adapter_slot"                      # its LoRA adapter waits for a device slot
    DISK_PREFETCH = "disk_prefetch"                    # its disk prefetch policy holds it
    GRAMMAR = "grammar"                                # its structured output's grammar compiles


@dataclass(frozen=True, slots=True)
class WaitReason:
    req_id: str
    reason: Hold                    # compares equal to its stable string, e.g. "capacity"
    detail: str                     # for a person: what held it and what ends the wait
    # The request the rule stopped at when it is not this one: the incomplete
    # prefill, the blocked admission in front, the waiting readmission.
    blocked_by: str | None = None
    # Capacity, for the request whose own admission failed: pages it needed
    # from the pool (including idle cached pages of its own prefix hit) and
    # the pages free then (evictable cached pages count as free, as in
    # `Planner.free_pages`). None for every other reason.
    pages_needed: int | None = None
    pages_free: int | None = None


class Stop:
    """Where a phase stopped a queue, and by which rule."""

    __slots__ = ("rule", "who", "needed", "free", "note")

    def __init__(self, rule: Hold, who: str | None, needed=None, free=None, note: str = ""):
        self.rule, self.who, self.needed, self.free, self.note = rule, who, needed, free, note


class WaitFacts:
    """What one round recorded about its waiting requests (last write wins:
    a later phase or retraction that tries the line again overwrites it)."""

    __slots__ = ("line", "readmission", "retraction", "served", "last_resort", "yielding")

    def __init__(self):
        self.line: Stop | None = None         # the waiting line (and D's remote admission)
        self.readmission: Stop | None = None  # the retracted set
        self.retraction = ""                  # why retraction did not free room, if it did not
        self.served: str | None = None        # whom this round's retraction freed pages for
        self.last_resort: str | None = None   # the liveness last resort's victim
        self.yielding: dict[str, str] = {}    # victim -> the request it yields to (§2)

    def stop_line(self, rule: Hold, who, note: str = "") -> None:
        self.line = Stop(rule, who.id if who is not None else None, note=note)

    def refused(self, req, coord) -> None:
        needed, free = coord.refused
        self.line = Stop(Hold.CAPACITY, req.id, needed, free)

    def line_closed(self, b, req) -> None:
        """The phase ended with `req` first in line and untried: say why."""
        if b.new_prompts_sealed:
            who = self.readmission.who if self.readmission else None
            self.line = Stop(Hold.READMISSION_SEAL, who)
        elif b.batch_left <= 0:
            self.stop_line(Hold.BUDGET, req, "the round's batch slots are full")
        elif b.budget <= 0:
            self.stop_line(Hold.BUDGET, req, "the round's token budget is spent")
        else:
            self.stop_line(Hold.DECODE_ROUND, req)


# ---- the query ---------------------------------------------------------------

_LINE_TEXT = {
    Hold.BEHIND_INCOMPLETE_PREFILL: (
        "", "behind {who}'s incomplete prefill: an incomplete prefill holds the line "
            "and new prompts may not pass it (§1.1){note}"),
    Hold.BUDGET: (
        "{note}; it is first in line next round",
        "behind {who} in FIFO order, which the round's budget stopped ({note}); "
        "nobody overtakes it"),
    Hold.CAPACITY: (
        "its admission needs {needed} pages, {free} free (evictable cached pages "
        "included); it waits for pages{note}",
        "behind {who}, whose admission failed for pages; nobody overtakes it"),
    Hold.SLIDING_ROOM: (
        "a sliding-window pool needs {needed} pages for it beside what its residents may "
        "still grow into (lookback and decode slot), {free} free; it waits for a resident "
        "to finish",
        "behind {who}, which waits for room in a sliding-window pool; nobody overtakes it"),
    Hold.READMISSION_SEAL: (
        "", "{who}'s readmission waits for pages, and new prompts are sealed behind it "
            "so that a newcomer cannot take the pages it waits for (§4)"),
    Hold.DECODE_ROUND: (
        "outside mixed mode a prefill cannot join a round that carries decodes; "
        "it is tried first next round",
        "behind {who}, which a decode round kept out (non-mixed mode)"),
    Hold.RETRACTION_GRANT: (
        "", "this round's retraction freed room for one admission and granted it to "
            "{who}; the line resumes next round (§2)"),
    Hold.LOCAL_RECOVERY: (
        "", "{who}'s local recovery claims this round to itself (§3.2)"),
    Hold.REMOTE_ADMISSION_LIMIT: (
        "", "at most one remote admission a round, and {who} took this one (§3.2)"),
    Hold.ADAPTER_SLOT: (
        "{note}",
        "behind {who}, whose LoRA adapter waits for a device slot; nobody overtakes it"),
    Hold.DISK_PREFETCH: (
        "its prefix is being read from the disk tier, and engine.disk_cache."
        "prefetch_policy holds it until the read completes (or times out)",
        "behind {who}, whose disk prefetch holds the line; nobody overtakes it"),
    Hold.GRAMMAR: (
        "its structured output's grammar is compiling (off the engine's loop); it is "
        "admitted once the grammar is ready, or fails if the compile runs out of time",
        "behind {who}, whose grammar is compiling; nobody overtakes it"),
}


def _line_reason(req, stop: Stop, retraction: str) -> WaitReason:
    own = stop.who == req.id
    text = _LINE_TEXT[stop.rule][0 if own else 1]
    note = stop.note
    if stop.rule is Hold.CAPACITY:
        note = f"; {retraction}" if retraction else ""
    elif stop.rule is Hold.BEHIND_INCOMPLETE_PREFILL and note:
        note = f"; {stop.who} {note}"
    detail = text.format(who=stop.who, note=note, needed=stop.needed, free=stop.free)
    if own:
        return WaitReason(req.id, stop.rule, detail, None, stop.needed, stop.free)
    return WaitReason(req.id, stop.rule, detail, stop.who)


def _victim_reason_text(req_id: str, facts: WaitFacts) -> str:
    if facts.last_resort == req_id:
        return ("retracted this round by the liveness last resort (a round built nothing; "
                "see Planner.stalls)")
    why = f" for {facts.served}" if facts.served and facts.served != req_id else ""
    return f"retracted this round to free pages{why} (§2)"


def _victim_reason(req, facts: WaitFacts) -> WaitReason:
    back = ("readmits through the readmission phase" if isinstance(req.state, Retracted)
            else "re-prefills through ordinary admission, at its submission position")
    return WaitReason(req.id, Hold.RETRACTED, f"{_victim_reason_text(req.id, facts)}; it {back}")


def _also_victim(reason: WaitReason, victims, facts: WaitFacts) -> WaitReason:
    """A victim the same round tried again: the later rule holds it; say both."""
    if reason.req_id not in victims:
        return reason
    how = _victim_reason_text(reason.req_id, facts)
    return WaitReason(reason.req_id, reason.reason, f"{reason.detail}. It was {how}",
                      reason.blocked_by, reason.pages_needed, reason.pages_free)


def _yield_reason(req, other: str) -> WaitReason:
    return WaitReason(req.id, Hold.YIELDS,
                      f"retracted to free pages for {other}, it re-enters once {other} is "
                      "served (admitted past its prompt, a step further, or gone), so the "
                      "pages it gave up do not come straight back to it (§2)", other)


def _readmission_reason(req, stop: Stop, facts: WaitFacts) -> WaitReason:
    if stop.rule is Hold.YIELDS:
        if stop.who == req.id:
            return _yield_reason(req, facts.yielding[req.id])
        return WaitReason(req.id, Hold.READMISSION_LIMIT,
                          f"{stop.who} is next in readmission order and yields this round; "
                          "the others wait behind it (§4)", stop.who)
    if stop.who == req.id and stop.rule is Hold.SLIDING_ROOM:
        return WaitReason(
            req.id, Hold.SLIDING_ROOM,
            f"its readmission needs {stop.needed} sliding-window pages beside what the "
            f"residents may still grow into, {stop.free} free; it waits for a resident to "
            "finish (§4: a readmission never triggers retraction)", None, stop.needed,
            stop.free)
    if stop.who == req.id and stop.rule is Hold.CAPACITY:
        return WaitReason(
            req.id, Hold.CAPACITY,
            f"its readmission needs {stop.needed} pages, {stop.free} free (evictable "
            "cached pages included); a readmission that does not fit waits and never "
            "triggers retraction (§4)", None, stop.needed, stop.free)
    if stop.rule is Hold.LOCAL_RECOVERY:
        return WaitReason(req.id, Hold.LOCAL_RECOVERY,
                          f"{stop.who}'s local recovery is in progress; one at a time (§3.2)",
                          stop.who)
    return WaitReason(req.id, Hold.READMISSION_LIMIT,
                      f"one readmission a round: {stop.who} goes first (generations a "
                      "client is reading first, then the oldest retraction) (§4)", stop.who)


def _not_planned(req) -> WaitReason:
    return WaitReason(req.id, Hold.NOT_YET_PLANNED,
                      "arrived after the last round was planned; the next round considers it")


def wait_reasons(p: PlannerState, last: tuple[WaitFacts, Plan, int, int] | None
                 ) -> list[WaitReason]:
    """One WaitReason per request in `p.waiting` (FIFO), `p.retracted`
    (readmission order) and `p.landing`. `last` is what the most recent
    build left: (facts, plan, next submission seq, last retraction epoch),
    or None before the first build. A request the round should have noted
    and did not is a planner bug, and raises."""
    if last is None:
        out = [_not_planned(r) for r in (*p.waiting, *p.retracted.values())]
    else:
        facts, plan, seq_mark, epoch_mark = last
        victims = {op.req.id for op in plan.retracts}
        out = _line_reasons(p, facts, victims, seq_mark)
        out += _retracted_reasons(p, facts, victims, epoch_mark)
    for req in p.landing.values():
        out.append(WaitReason(
            req.id, Hold.WAITING_FOR_PREFILL,
            "a P engine is prefilling it into reserved landing pages; it decodes here "
            "once its KV and first token land (§3.2)"))
    return out


def _line_reasons(p: PlannerState, facts: WaitFacts, victims, seq_mark: int) -> list[WaitReason]:
    stop = facts.line
    retraction = facts.retraction
    if not p.decodes_locally:
        retraction = "P never retracts: pages come back as the peer acks shipped prompts"
    elif facts.served and stop and facts.served != stop.who:
        retraction = f"this round's retraction freed pages for {facts.served}, which failed first"
    out = []
    for req in p.waiting:
        if req.seq >= seq_mark:
            out.append(_not_planned(req))
        elif stop is not None and stop.who == req.id:
            out.append(_also_victim(_line_reason(req, stop, retraction), victims, facts))
        elif req.id in victims:
            out.append(_victim_reason(req, facts))
        elif req.id in facts.yielding:
            out.append(_yield_reason(req, facts.yielding[req.id]))
        elif stop is None:
            raise AssertionError(f"planner bug: {req.id} waits, the round noted no rule")
        else:
            out.append(_line_reason(req, stop, retraction))
    return out


def _readmission_order(req) -> tuple[bool, int]:
    """Planner.next_readmission's: generations a client is reading first,
    then the oldest retraction."""
    st = req.state
    assert isinstance(st, Retracted)            # `retracted` holds Retracted requests only
    return not st.resumes_generation, st.epoch


def _retracted_reasons(p: PlannerState, facts: WaitFacts, victims,
                       epoch_mark: int) -> list[WaitReason]:
    stop = facts.readmission
    order = sorted(p.retracted.values(), key=_readmission_order)
    out = []
    for req in order:
        st = req.state
        assert isinstance(st, Retracted)
        if st.epoch > epoch_mark:
            out.append(_not_planned(req))            # e.g. its transfer failed since
        elif stop is not None and stop.who == req.id and stop.rule is Hold.CAPACITY:
            out.append(_also_victim(_readmission_reason(req, stop, facts), victims, facts))
        elif req.id in victims:
            out.append(_victim_reason(req, facts))
        elif stop is None:
            raise AssertionError(f"planner bug: {req.id} is retracted, the round noted no "
                                 "readmission")
        else:
            out.append(_readmission_reason(req, stop, facts))
    return out
