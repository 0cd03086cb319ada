"""Local prefill: readmission of a retracted request, the next chunks of
admitted prompts, and new prompts with their first chunk (spec §1, §2, §4)."""

from __future__ import annotations

import pdserve.scheduler.fsm as fsm
from pdserve.scheduler.cache.demands import demands, sliding_room
from pdserve.scheduler.chunking import (
    admission_headroom, prefill_chunk_tokens, prefill_reserve, replay_rows)
from pdserve.scheduler.fsm import Resources
from pdserve.scheduler.plan import PrefillOp
from pdserve.scheduler.plan_state import PlannerState
from pdserve.scheduler.request import Request
from pdserve.scheduler.round.build import PlanBuild
from pdserve.scheduler.round.waiting import Hold, Stop


def decode_headroom(p: PlannerState, req) -> tuple[int, int]:
    """(headroom, remaining): the decode room an admission must secure (§4)."""
    remaining = req.remaining_new_tokens
    if not p.decodes_locally:
        return 0, remaining
    if req.limits.strict:
        return remaining, remaining
    return admission_headroom(remaining, p.cfg.safe_steps, req.retractions), remaining


def yields(p: PlannerState, req: Request, b: PlanBuild | None = None) -> bool:
    """§2's anti-thrash rule: a retraction victim does not re-enter (by
    readmission, or by admission as a re-queued newcomer) ahead of the
    request it was retracted for. It yields while that one is live and
    still in the prefill line (waiting or mid-prompt), or resident and not
    yet a step further than it stood at the retraction; once that one is
    served, left, or was itself retracted, the victim competes as usual.
    Without this the pages a retraction freed go straight back to the
    victim's readmission, and the two swap every round. Notes the yield
    in `b.waits` for the operator's query."""
    held = req.yields_to
    if held is None:
        return False
    other, tokens = held
    st = other.state
    if p.requests.get(other.id) is other and (
            isinstance(st, (fsm.Waiting, fsm.Prefilling))
            or (st.holds_pages and other.num_tokens == tokens)):
        if b is not None:
            b.waits.yielding[req.id] = other.id
        return True
    req.yields_to = None
    return False


def resume_point(computed: int, target: int, page_size: int) -> int:
    """Where a readmission resumes (§1.3, §4): on the page boundary at or
    below what its snapshot computed, unless only the last token is left
    (a prompt-done victim feeding the token it sampled). A mid-page point
    comes only from bounded replay's final-window cut, and resuming there
    would re-feed up to a page more than the window: beside the window of
    new tokens the final chunk must carry, more than the budget that
    `min_prefill_tokens` sized for page-aligned points, so the request
    could never advance. The rows between go back through the forward."""
    if computed >= target - 1:
        return computed
    return computed // page_size * page_size


def readmission_phase(p: PlannerState, b: PlanBuild) -> bool:
    """At most one readmission a round: the retracted request that resumes a
    generation a client is reading first, then the oldest retraction. It
    re-probes the device cache, loads the rest of its snapshot, and resumes
    where that leaves it. One that does not fit waits, is never a capacity
    blocker, and holds back new prompts (a newcomer taking its pages would
    starve it). Returns whether it readmitted."""
    req = p.next_readmission()
    if req is None:
        return False
    if yields(p, req, b):
        # it holds nothing and seals nothing: the request it yields to may
        # be a waiting prompt, which a seal would starve
        b.waits.readmission = Stop(Hold.YIELDS, req.id)
        return False
    st = req.state
    assert isinstance(st, fsm.Retracted)        # next_readmission picks from `retracted`
    ps = p.page_size
    hit = p.coord.match(req, (st.target - 1) // ps, use_host=False)
    start = max(resume_point(st.computed, st.target, ps), hit.pages * ps)
    # bounded replay is never carried across a retraction: re-derived from
    # where this readmission resumes (§4)
    replay = replay_rows(start, p.replay_tokens, ps)
    headroom, remaining = decode_headroom(p, req)
    tokens = start + 1 if start == st.target else start
    # like a first chunk: the rest of the history and the headroom, never
    # less than the completing chunk's decode slot (§1.4)
    reserve = prefill_reserve(decodes_locally=True, first_chunk=True, completes=False,
                              rest_of_prompt=st.target - start, headroom=headroom,
                              decode_width=p.cfg.decode_input_tokens)
    short = sliding_room(p, max(1, tokens - start) + replay)
    if short is not None:
        b.new_prompts_sealed = True
        b.waits.readmission = Stop(Hold.SLIDING_ROOM, req.id, *short)
        return False
    res = Resources(len(p.coord.groups))
    if not p.coord.admit(req, res, demands(p, start, tokens, reserve, 0, replay), hit.pages,
                         b.plan, hit=hit):
        b.new_prompts_sealed = True
        needed, free = p.coord.refused
        b.waits.readmission = Stop(Hold.CAPACITY, req.id, needed, free)
        return False
    b.waits.readmission = Stop(Hold.READMISSION_LIMIT, req.id)
    res.covers_generation = headroom >= remaining
    p.coord.load_snapshot(req.id, res, st.snapshot, hit.pages, b.plan)
    fsm.readmit(req, res, start, replay)
    p.readmitted(req)
    b.plan.readmits.append(req)
    b.prefill_progressed = True
    return True


def try_resident_chunk(p: PlannerState, b: PlanBuild, req) -> bool | None:
    """Schedule the next chunk of an admitted prefill. None: the budget
    cannot reach a boundary; False: admission failed."""
    st = req.state
    begin, target, replay = st.window_end, st.target, st.replay
    chunk = prefill_chunk_tokens(begin, target, b.budget - replay, p.prefix_tokens,
                                 p.replay_tokens)
    if chunk == 0:
        return None
    end = begin + chunk
    completes = end == target
    width = p.cfg.decode_input_tokens
    reserve = prefill_reserve(
        decodes_locally=p.decodes_locally, first_chunk=False, completes=completes,
        rest_of_prompt=target - end, headroom=0, decode_width=width)
    res = st.res
    if not p.coord.admit(req, res, demands(p, begin, end, reserve, width if completes else 0,
                                           replay), begin // p.page_size, b.plan):
        return False
    fsm.advance_prefill(req, end)
    b.push_prefill(PrefillOp(req, begin, chunk, completes, replay), res)
    if completes:
        p.prefill_completed(req)
    else:
        b.sealed = True
        b.waits.stop_line(Hold.BEHIND_INCOMPLETE_PREFILL, req)
    return True


def resident_prefill_phase(p: PlannerState, b: PlanBuild) -> None:
    """Next chunks of prefills already admitted, FIFO. An incomplete chunk,
    or a resident that cannot advance, seals the line behind it."""
    for req in list(p.prefilling.values()):
        if b.sealed or not b.can_prefill():
            return
        st = req.state
        assert isinstance(st, fsm.Prefilling)   # `prefilling` holds Prefilling requests only
        if st.res.disk_hold >= 0:
            # engine.overlap: a round built while its admission's forward
            # runs, its disk read not yet confirmed (a miss retracts it
            # at that round's apply); its next chunk waits (never without
            # overlap: every read is acked in its own round)
            b.sealed = True
            b.waits.stop_line(Hold.BEHIND_INCOMPLETE_PREFILL, req,
                              "could not advance: its disk read is not confirmed yet")
            return
        ok = try_resident_chunk(p, b, req)
        if ok is None:
            b.sealed = True
            b.waits.stop_line(Hold.BEHIND_INCOMPLETE_PREFILL, req,
                              "could not advance: the budget left cannot reach a page boundary")
        elif ok is False:
            b.fail(req)
            b.sealed = True
            b.waits.stop_line(Hold.BEHIND_INCOMPLETE_PREFILL, req,
                              "could not advance: its next chunk failed admission for pages")


def try_new_prompt(p: PlannerState, b: PlanBuild, req) -> bool | None:
    """Admit a waiting request with its first chunk. None: the budget cannot
    reach a boundary; False: admission failed."""
    cfg = p.cfg
    ps = p.page_size
    target = req.num_tokens
    if req.disk_wait:
        b.waits.stop_line(Hold.DISK_PREFETCH, req)
        return None
    if req.grammar_wait:
        b.waits.stop_line(Hold.GRAMMAR, req)
        return None
    hit = p.coord.match(req, (target - 1) // ps)
    if req.disk_pages > hit.pages:
        hit = p.coord.disk_hit(req, hit, (target - 1) // ps, max(p.prefix_tokens // ps, 1))
    begin = hit.pages * ps
    replay = replay_rows(begin, p.replay_tokens, ps)
    chunk = prefill_chunk_tokens(begin, target, b.budget - replay, p.prefix_tokens,
                                 p.replay_tokens)
    if chunk == 0:
        b.waits.stop_line(Hold.BUDGET, req, f"the budget left ({b.budget} tokens) cannot "
                          f"reach a page boundary of its prompt"
                          + (f" beside {replay} replayed rows" if replay else ""))
        return None
    end = begin + chunk
    completes = end == target
    headroom, remaining = decode_headroom(p, req)
    width = cfg.decode_input_tokens
    reserve = prefill_reserve(
        decodes_locally=p.decodes_locally, first_chunk=True, completes=completes,
        rest_of_prompt=target - end, headroom=headroom, decode_width=width)
    short = sliding_room(p, chunk + replay)
    if short is not None:
        # not a capacity blocker: the residents free the room as they
        # finish, and retracting one for a newcomer would only trade places
        b.waits.line = Stop(Hold.SLIDING_ROOM, req.id, *short)
        return None
    if not adapter_slot_free(p, b, req):
        return None
    res = Resources(len(p.coord.groups))
    if not p.coord.admit(req, res, demands(p, begin, end, reserve, width if completes else 0,
                                           replay), hit.pages - hit.disk, b.plan, hit=hit):
        b.waits.refused(req, p.coord)
        return False
    res.covers_generation = headroom >= remaining
    req.cached = (hit.device_end * ps, len(hit.host) * ps, hit.disk * ps)
    if not req.retractions:
        p.hits.count(req.prompt_len, req.cached)    # a prompt's first admission only
    if p.waiting[0] is req:
        p.waiting.popleft()
    else:
        p.waiting.remove(req)             # a grant redirected past a retracted victim
    p.take_slot(req)
    p.lora.take(req)
    fsm.start_prefill(req, res, end, target)
    b.push_prefill(PrefillOp(req, begin, chunk, completes, replay), res)
    if completes:
        p.prefill_completed(req)
    else:
        p.prefilling[req.id] = req
        b.sealed = True
        b.waits.stop_line(Hold.BEHIND_INCOMPLETE_PREFILL, req)
    return True


def adapter_slot_free(p: PlannerState, b: PlanBuild, req) -> bool:
    """Whether `req`'s adapter holds a slot or a quiescent one is there to
    take; if not, it holds the line (adapter_slots.py) until a slot drains."""
    if p.lora.can_take(req.adapter):
        return True
    b.waits.stop_line(Hold.ADAPTER_SLOT, req,
                      f"its LoRA adapter (load {req.adapter}) needs a device slot and all "
                      f"{p.lora.slots} (lora.max_loras) serve live requests or pinned "
                      "adapters; it is admitted "
                      "once one of them drains")
    return False


def new_prompt_phase(p: PlannerState, b: PlanBuild) -> None:
    """Admit waiting requests in FIFO order, each with its first chunk. The
    first one that does not fit stops the phase: nobody overtakes it."""
    while not b.sealed and not b.new_prompts_sealed and b.can_prefill():
        # a re-queued victim steps aside for the request it was retracted for (§2)
        req = first_in_line(p, b)
        if req is None:
            return
        ok = try_new_prompt(p, b, req)
        if ok is None:
            b.sealed = True
        elif ok is False:
            b.fail(req)
            b.sealed = True
    req = first_in_line(p, b)
    if req is not None and not b.sealed:  # a sealed line already noted who sealed it
        b.waits.line_closed(b, req)


def first_in_line(p: PlannerState, b: PlanBuild | None, skip=None):
    """The first waiting request, FIFO, that does not yield (`yields`)."""
    return next((r for r in p.waiting if r is not skip and not yields(p, r, b)), None)
