"""The phases a role grammar strings together, and the round they build.

`PlanBuild` is the round under construction: the output plan, the token
budget and batch slots left, which lines are sealed, and the admission
feedback (did anything fail for capacity, and who first). Every operation
enters the batch through `push_decode` / `push_prefill`, where the
accounting lives. Phases read candidates in FIFO order and schedule each
request at most once a round.

Each `try_*` helper admits one request or changes nothing; the phases call
them in order, and retraction (retraction.py) calls them again to retry the
request it freed room for. Where a phase stops the waiting line or tries a
readmission, it notes the rule in `PlanBuild.waits` (waiting.py) for the
operator's `Planner.waiting_reasons()`; the plan never reads it.
"""

from __future__ import annotations

import pdserve.scheduler.fsm as fsm
from pdserve.scheduler.chunking import (
    admission_headroom, prefill_chunk_tokens, prefill_reserve, replay_rows)
from pdserve.scheduler.demands import demands, sliding_room
from pdserve.scheduler.overlap import runs_ahead
from pdserve.scheduler.fsm import PrefillDone, RemotePrefillDone, Resources
from pdserve.scheduler.group_pools import SnapshotStateGroup
from pdserve.scheduler.plan import Plan, PrefillOp, RemoteDecodeOp, RemotePrefillOp
from pdserve.scheduler.plan_state import PlannerState
from pdserve.scheduler.request import Request
from pdserve.scheduler.speculation import verify_width
from pdserve.scheduler.waiting import Hold, Stop, WaitFacts

_FIRST_DECODE = (PrefillDone, RemotePrefillDone)


class PlanBuild:
    __slots__ = ("plan", "budget", "batch_left", "sealed", "new_prompts_sealed",
                 "capacity_blocker", "admission_failed", "prefill_progressed",
                 "decodes_use_budget", "prefill_may_join", "waits")

    def __init__(self, plan: Plan, budget: int, batch: int, decodes_use_budget: bool,
                 mixed: bool, waits: WaitFacts | None = None):
        self.plan = plan
        self.budget = budget
        self.batch_left = batch
        self.sealed = False              # an incomplete prefill holds the line (§1.1)
        self.new_prompts_sealed = False  # a waiting readmission holds new prompts (§4)
        self.capacity_blocker: Request | None = None   # first request whose admission failed
        self.admission_failed = False
        self.prefill_progressed = False
        self.decodes_use_budget = decodes_use_budget
        self.prefill_may_join = mixed    # non-mixed: no prefill beside decodes
        self.waits = waits if waits is not None else WaitFacts()   # why the rest wait

    def fail(self, req) -> None:
        self.admission_failed = True
        if self.capacity_blocker is None:
            self.capacity_blocker = req

    def can_prefill(self) -> bool:
        if self.budget <= 0 or self.batch_left <= 0:
            return False
        return self.prefill_may_join or not self.plan.decodes

    def can_decode(self) -> bool:
        if self.batch_left <= 0 or (self.decodes_use_budget and self.budget <= 0):
            return False
        return self.prefill_may_join or not self.plan.prefills

    def push_decode(self, req, res: Resources) -> None:
        self.plan.decodes.append(req)
        self.batch_left -= 1
        if self.decodes_use_budget:
            self.budget -= 1
        res.forwards_out += 1

    def push_prefill(self, op: PrefillOp, res: Resources) -> None:
        self.plan.prefills.append(op)
        self.budget -= op.tokens + op.replay
        self.batch_left -= 1
        self.prefill_progressed = True
        res.forwards_out += 1


# ---- decode -----------------------------------------------------------------

def try_decode(p: PlannerState, b: PlanBuild, req, width: int = 0) -> bool:
    """Admit the page a decode crosses into (a verify row: every page its
    `width` candidates write too), and, on the first decode, publish the
    prompt's pages; False if the pool cannot supply it."""
    st = req.state
    ps = p.page_size
    n = req.num_tokens
    if not p.coord.admit(req, st.res, demands(p, n - 1, n + width, 0, 0, decode=True),
                         (n - 1) // ps, b.plan):
        return False
    if st.__class__ in _FIRST_DECODE:
        fsm.begin_decoding(req)
    return True


def decode_phase(p: PlannerState, b: PlanBuild) -> None:
    """Every PrefillDone first decode and Decoding step, FIFO, while batch
    slots (and, where decodes spend it, token budget) last. A decode that
    stays inside its held pages does no allocator work."""
    if not b.can_decode():
        return
    limit = b.batch_left
    tokens = None                           # the budget decodes may spend (None: no budget)
    if b.decodes_use_budget:
        # with bounded replay a hit's first chunk needs its replay rows and
        # a page beside them: leave that much for a prefill waiting (§1.3)
        keep = p.min_prefill_tokens if (p.waiting or p.prefilling) else 0
        tokens = max(b.budget - keep, 1 if not b.plan.prefills else 0)
        limit = min(limit, tokens)
    decodes = b.plan.decodes
    n = extra = 0
    for req in p.running.values():
        st = req.state
        assert isinstance(st, fsm.Holding)      # running: PrefillDone, Decoding, RemotePrefillDone
        width = 0
        if st.res.forwards_out:
            if not runs_ahead(p, b.plan, req):  # engine.overlap: a decode in flight goes again
                continue
        else:
            if req.drafts:                  # a verify row (speculation.py)
                width = verify_width(req, None if tokens is None else tokens - n - extra)
            if req.num_tokens + width > req.capacity or st.__class__ in _FIRST_DECODE:
                # short of pages for the candidates, a plain decode may still fit
                if not try_decode(p, b, req, width) and not (
                        width and req.num_tokens > req.capacity and try_decode(p, b, req)):
                    b.fail(req)
                    continue
                if req.num_tokens + width > req.capacity:
                    width = 0
                st = req.state
                assert isinstance(st, fsm.Holding)  # try_decode began its decoding
        st.res.forwards_out += 1
        decodes.append(req)
        if width:
            b.plan.verify[req.id] = req.drafts[:width]
            extra += width
        n += 1
        if n == limit or (tokens is not None and n + extra >= tokens):
            break
    b.batch_left -= n
    if b.decodes_use_budget:
        b.budget -= n + extra


# ---- local prefill ----------------------------------------------------------

def _headroom(p: PlannerState, req) -> tuple[int, int]:
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
    headroom, remaining = _headroom(p, req)
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
    headroom, remaining = _headroom(p, req)
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


# ---- disaggregation ---------------------------------------------------------

def try_remote_admission(p: PlannerState, b: PlanBuild, req) -> bool | None:
    """D: reserve the whole prompt's landing pages plus the admission
    headroom (the peer prefills it: there is no mid-way), reuse what the
    local prefix cache holds, and ask a peer for the rest. None: a sliding
    pool's residents may still grow into the room (not a capacity blocker)."""
    ps = p.page_size
    n = req.num_tokens
    if req.disk_wait:
        b.waits.stop_line(Hold.DISK_PREFETCH, req)
        return None
    # the peer sends each sliding group's last window and the final state:
    # only the full history's hit counts here; host and disk hits where a
    # disk tier can be read, the peer asked only for the rest
    local = p.coord.landing_serves_disk
    hit = p.coord.match(req, (n - 1) // ps, sliding=False, use_host=local)
    if local and req.disk_pages > hit.pages:
        hit = p.coord.disk_hit(req, hit, (n - 1) // ps, max(p.prefix_tokens // ps, 1),
                               landing=True)
    headroom, remaining = _headroom(p, req)
    short = sliding_room(p, 1)
    if short is not None:
        b.waits.line = Stop(Hold.SLIDING_ROOM, req.id, *short)
        return None
    if not adapter_slot_free(p, b, req):
        return None                       # not for pages: retraction would not help
    res = Resources(len(p.coord.groups))
    if not p.coord.admit(req, res, demands(p, n, n, headroom, p.cfg.decode_input_tokens,
                                           lands=True), hit.pages - hit.disk, b.plan, hit=hit):
        b.waits.refused(req, p.coord)
        return False
    res.covers_generation = headroom >= remaining
    # D's own hit; P computes or finds the rest. A disk read that misses
    # withholds the ask (Planner._disk_missed), so P's pages never land
    # on prefix pages the disk did not fill (§4)
    req.cached = (hit.device_end * ps, len(hit.host) * ps, hit.disk * ps)
    if not req.retractions:
        p.hits.count(req.prompt_len, req.cached)    # D's first admission, as P counts its own
    if p.waiting[0] is req:
        p.waiting.popleft()
    else:
        p.waiting.remove(req)
    p.take_slot(req)
    p.lora.take(req)
    fsm.start_remote_prefill(req, res, hit.pages)
    p.landing[req.id] = req
    b.plan.remote_prefills.append(RemotePrefillOp(req, hit.pages, transfer_slots(p, res, n,
                                                                                 hit.pages)))
    b.prefill_progressed = True
    b.waits.stop_line(Hold.REMOTE_ADMISSION_LIMIT, req)
    return True


def remote_admission_phase(p: PlannerState, b: PlanBuild) -> None:
    """D: at most one remote admission a round (each reserves a whole
    prompt; a queue's worth at once would drain the pool before any KV
    arrives). It rides beside the batch: no token budget, no batch slot."""
    if not p.waiting:
        return
    if b.new_prompts_sealed:
        b.waits.line_closed(b, p.waiting[0])
        return
    if b.plan.remote_prefills:
        return                            # its admission noted the limit
    req = p.waiting[0]
    if try_remote_admission(p, b, req) is False:
        b.fail(req)


def local_recovery_phase(p: PlannerState, b: PlanBuild) -> bool:
    """D: a resident recovery chunk if one is mid-prompt, else the one
    readmission this round may start; either claims the round to itself.
    Returns whether it did."""
    for req in p.prefilling.values():
        b.waits.readmission = Stop(Hold.LOCAL_RECOVERY, req.id)
        ok = try_resident_chunk(p, b, req)
        if ok:
            b.waits.stop_line(Hold.LOCAL_RECOVERY, req)
            return True
        if ok is False:
            b.fail(req)
        return False
    if readmission_phase(p, b):
        req = b.plan.readmits[-1]
        if req.id in p.prefilling:
            try_resident_chunk(p, b, req)
        b.waits.stop_line(Hold.LOCAL_RECOVERY, req)
        return True
    return False


def ship_phase(p: PlannerState, b: PlanBuild) -> None:
    """P: completed prompts out first. Their pages stay pinned until the
    peer acks, so releasing them outranks feeding more prompt work."""
    ps = p.page_size
    for req in list(p.running.values()):
        st = req.state
        assert isinstance(st, fsm.Holding)      # running on P: PrefillDone
        res = st.res
        p.coord.publish(req, res, (req.num_tokens - 1) // ps)
        p.coord.trim(res, req.num_tokens - 1)      # pinned until the ack: only what travels
        fsm.start_transfer(req)
        del p.running[req.id]
        p.transferring[req.id] = req
        src = transfer_slots(p, res, req.num_tokens - 1, req.first_page)
        b.plan.remote_decodes.append(RemoteDecodeOp(req, src, req.output[0], list(req.drafts)))


def transfer_slots(p: PlannerState, res, prompt_len: int, first_page: int) -> list[list[int]]:
    """Per group, the pages a P -> D transfer of a `prompt_len`-token prompt
    moves: the full history from the first page D lacks, each sliding
    group's last window (the slots D's first decode reads), never the whole
    prompt, and the state group's final state. The same slots on both
    sides: D's landing pages and P's sources."""
    end = -(-prompt_len // p.page_size)
    out = []
    for g, table in zip(p.coord.groups, res.tables):
        if g.spec.state:
            assert isinstance(g, SnapshotStateGroup)    # make_group: a state spec's group
            e = g.entry(prompt_len)     # the final state alone (§1.2: endpoint-only landing)
            out.append(table[e:e + 1])
            continue
        lo = g.first_live(prompt_len) if g.spec.sliding else first_page
        out.append(table[lo:end])
    return out
