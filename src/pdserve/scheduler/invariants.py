"""The planner's invariants: what `Planner.check_invariants()` checks after
any step, and what `Planner.assert_idle()` adds at the end of a lifecycle
(STYLE §6: every lifecycle test ends by asserting that nothing leaked).

Each function takes the planner; the coordinator checks its own pools,
indexes and tickets (coordinator.py, host_tier.py). A failure raises
AssertionError (or the pools' PoolError) naming the request and the rule.
"""

from __future__ import annotations

import pdserve.scheduler.fsm as fsm
from pdserve.scheduler.cache.groups import HOLE
from pdserve.scheduler.capacity import sliding_request_pages
from pdserve.scheduler.fsm import (
    Decoding, PrefillDone, Prefilling, RemotePrefillDone, RemotePrefilling, Retracted,
    Transferring)
from pdserve.scheduler.cache.group_pools import SnapshotStateGroup
from pdserve.scheduler.round.overlap import check_ending
from pdserve.scheduler.plan_state import PlannerState


def check_invariants(planner: PlannerState) -> None:
    """Pool and index consistency, and that every live request is in
    exactly the collection its state says."""
    planner.lora.check_invariants(planner.requests.values())
    live, live_ids, snapshots = [], [], []
    for req in planner.requests.values():
        st = req.state
        where: tuple[bool, ...] = (req in planner.waiting, req.id in planner.prefilling,
                                   req.id in planner.running, req.id in planner.retracted,
                                   req.id in planner.landing, req.id in planner.transferring)
        kinds = (fsm.Waiting, Prefilling, (PrefillDone, Decoding, RemotePrefillDone),
                 Retracted, RemotePrefilling, Transferring)
        want = tuple(isinstance(st, k) for k in kinds)
        if isinstance(st, Retracted):
            snapshots.append(st.snapshot)
        if not any(want):
            raise AssertionError(f"{req.id}: terminal state {st} still live")
        if req.id in planner.ending:        # engine.overlap: off the schedule (overlap.py)
            check_ending(planner, req, where)
            where = want
        if where != want:
            raise AssertionError(f"{req.id} in {where}, state {type(st).__name__}")
        if st.holds_pages:
            assert isinstance(st, fsm.Holding)
            live.append(st.res.tables)
            live_ids.append(req.id)
            if req.capacity != min(len(t) for t in st.res.tables) * planner.page_size:
                raise AssertionError(f"{req.id}: capacity out of step with its tables")
            _check_windows(planner, req)
            _check_states(planner, req)
            if req.num_tokens > req.capacity + 1 and isinstance(st, Decoding):
                raise AssertionError(f"{req.id}: more than one token beyond capacity")
    counted = (len(planner.waiting) + len(planner.prefilling) + len(planner.running)
               + len(planner.retracted) + len(planner.landing) + len(planner.transferring)
               + len(planner.ending))
    if counted != len(planner.requests):
        raise AssertionError("a request sits in no queue or in two")
    for coll in (planner.prefilling, planner.running):
        seqs = [r.seq for r in coll.values()]
        if seqs != sorted(seqs):
            raise AssertionError("a resident collection is out of submission order")
    planner.coord.check_invariants(live, snapshots, live_ids)


def _check_windows(planner: PlannerState, req) -> None:
    """A sliding group holds no slot below the window of the forward it
    was last admitted for, and every slot from there to its end."""
    for g, table in zip(planner.groups, req.state.res.tables):
        if not g.sliding or not table:
            continue
        held = [i for i, page in enumerate(table) if page != HOLE]
        if held and held != list(range(held[0], len(table))):
            raise AssertionError(f"{req.id}: a hole inside its sliding window")
        lowest = g.first_live_page(fsm.computed_tokens(req), planner.page_size)
        if held and held[0] > lowest and not isinstance(req.state, RemotePrefilling):
            raise AssertionError(f"{req.id}: sliding window starts at slot {held[0]}, "
                                 f"its next forward reads slot {lowest}")
        cfg = planner.cfg
        if len(held) > sliding_request_pages(cfg, g.window, cfg.max_scheduled_tokens):
            raise AssertionError(f"{req.id}: holds {len(held)} sliding pages, more than "
                                 "its window, a chunk and its decode slot")


def _check_states(planner: PlannerState, req) -> None:
    """A state group holds slots only at block ends, the state of the
    computed frontier among them (unless it is still arriving), and no
    more than one chunk's read, checkpoint and final state beside its
    growth blocks."""
    g = planner.coord.state
    if g is None:
        return
    grp, table = planner.coord.groups[g], req.state.res.tables[g]
    assert isinstance(grp, SnapshotStateGroup)      # make_group: a state spec's group
    held = [i for i, s in enumerate(table) if s != HOLE]
    if any((i + 1) % grp.per_block for i in held):
        raise AssertionError(f"{req.id}: a state slot off a block end: {table}")
    computed = fsm.computed_tokens(req)
    if computed and grp.entry(computed) not in held \
            and not isinstance(req.state, RemotePrefilling):
        raise AssertionError(f"{req.id}: no state for its {computed} computed tokens")
    if len(held) > 3 + -(-planner.state_reserve // grp.block):
        raise AssertionError(f"{req.id}: holds {len(held)} state slots: {table}")


def assert_idle(planner: PlannerState) -> None:
    """Nothing live and no page held: what every lifecycle ends with."""
    check_invariants(planner)
    if planner.requests:
        raise AssertionError(f"{len(planner.requests)} requests still live")
    c = planner.coord
    if c.fences:
        raise AssertionError(f"{len(c.fences)} fences still hold pages")
    if c.stores or c.loads or c.pending_stores or c.host_cache.disk_loads:
        raise AssertionError("copies still in flight")
    for g, grp in enumerate(c.groups):
        if c.available_pages(g) != grp.pool.total:
            raise AssertionError(f"group {g}: {grp.pool.total - c.available_pages(g)} "
                                 "pages still held")
    for host in c.hosts:
        if host.pool.num_free + host.index.num_idle != host.pool.total:
            raise AssertionError("host pages still held")
