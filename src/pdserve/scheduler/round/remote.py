"""Disaggregation's phases: D's remote admission and local recovery, and
P's shipping of completed prompts (with the slots a transfer moves)."""

from __future__ import annotations

import pdserve.scheduler.fsm as fsm
from pdserve.scheduler.cache.demands import demands, sliding_room
from pdserve.scheduler.cache.group_pools import SnapshotStateGroup
from pdserve.scheduler.fsm import Resources
from pdserve.scheduler.plan import RemoteDecodeOp, RemotePrefillOp
from pdserve.scheduler.plan_state import PlannerState
from pdserve.scheduler.round.build import PlanBuild
from pdserve.scheduler.round.prefill import (
    adapter_slot_free, decode_headroom, readmission_phase, try_resident_chunk)
from pdserve.scheduler.round.waiting import Hold, Stop


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
    if req.grammar_wait:            # D matches P's first token against it: ready first
        b.waits.stop_line(Hold.GRAMMAR, req)
        return None
    # the peer sends each sliding group's last window and the final state:
    # only the full history's hit counts here; host and disk hits where a
    # disk tier can be read, the peer asked only for the rest
    local = p.coord.landing_serves_disk
    hit = p.coord.match(req, (n - 1) // ps, sliding=False, use_host=local)
    if local and req.disk_pages > hit.pages:
        hit = p.coord.disk_hit(req, hit, (n - 1) // ps, max(p.prefix_tokens // ps, 1),
                               landing=True)
    headroom, remaining = decode_headroom(p, req)
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
