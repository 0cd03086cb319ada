"""What a forward asks of each cache group's pool (`demands`), and whether
a new resident leaves a sliding pool room for the residents to grow
(`sliding_room`). The phases (round/) and a decode that runs ahead
(overlap.py) size every admission with these.
"""

from __future__ import annotations

from pdserve.scheduler.capacity import sliding_request_pages
from pdserve.scheduler.fsm import Holding
from pdserve.scheduler.cache.group_pools import GroupDemand
from pdserve.scheduler.plan_state import PlannerState


def demands(p: PlannerState, begin: int, end: int, reserve: int, sliding_reserve: int,
            replay: int = 0, decode: bool = False, lands: bool = False) -> list[GroupDemand]:
    """One demand per group for a forward computing rows [begin - replay,
    end): the full-history group holds `reserve` beyond end, each sliding
    group only `sliding_reserve` (§1: the decode slot, never headroom) and
    lets go of what slid out of the window of its first row. A state group
    (§1.2) reserves a growth block where the prompt's shaping ends on a
    decoding role (the completing chunk or the landing: `sliding_reserve`
    set), nothing elsewhere; a decode (`decode`) records no checkpoint, nor
    does anything with engine.state_checkpoints off; a landing (`lands`)
    receives its state instead of computing it."""
    full = GroupDemand(end, reserve, begin)
    if len(p.groups) == 1 and p.coord.full == 0:
        return [full]
    out = []
    for g in p.groups:
        if g.state:
            grows = sliding_reserve and p.decodes_locally
            out.append(GroupDemand(end, p.state_reserve if grows else 0, begin, lands=lands,
                                   records=not decode and p.cfg.state_checkpoints))
        elif not g.sliding:
            out.append(full)
        elif replay:
            # the replayed rows are the first this group has: its table
            # starts at their (page-aligned) first row, so the window of a
            # re-fed row reads only rows this forward writes
            out.append(GroupDemand(end, sliding_reserve, begin - replay + g.window - 1))
        else:
            out.append(GroupDemand(end, sliding_reserve, begin))
    return out


def sliding_room(p: PlannerState, chunk_tokens: int) -> tuple[int, int] | None:
    """A new resident (a first chunk, a readmission, a landing) joins a
    sliding-window pool only while every resident can still grow to its
    decode footprint (lookback, decode slot, a window starting mid-page)
    beside the newcomer's own worst case for this chunk. A sliding group
    holds no headroom (§1), so without this check two residents can each
    wait for a page the other holds, and when one of them is exempt from
    retraction (its full-history prepay covers its generation) nothing
    frees it: the liveness last resort runs. A pool sized by default
    (capacity.group_pages) holds max_batch_size such footprints and a chunk,
    so the check binds only on a smaller engine.sliding_pages. None if
    there is room, else (pages needed, pages free) of the first short pool."""
    cfg = p.cfg
    for gi, g in enumerate(p.coord.groups):
        if not g.spec.sliding:
            continue
        grown = sliding_request_pages(cfg, g.spec.window, 1)
        owed = 0
        for coll in (p.prefilling, p.running, p.landing):
            for r in coll.values():
                st = r.state
                assert isinstance(st, Holding)      # residents and landings hold pages
                held = sum(1 for pg in st.res.tables[gi] if pg >= 0)
                owed += max(0, grown - held)
        needed = owed + sliding_request_pages(cfg, g.spec.window, chunk_tokens)
        free = p.coord.available_pages(gi)
        if free < needed:
            return needed, free
    return None
