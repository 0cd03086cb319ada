"""A round's copies between the tiers, before its forward: stores from
device to host (and, with a disk tier, on to disk), then loads from host
back to device, each acked in the round's result."""

from __future__ import annotations

import torch

from pdserve.scheduler.plan import Plan, StepResult


def copy_between_tiers(ex, plan: Plan) -> tuple[StepResult, set[str]]:
    """Stores, then loads, each acked: done before the forward reads them.
    `ex` is the TorchExecutor. Also returns the requests whose disk read
    missed this round (they sample nothing; the planner retracts them)."""
    result = StepResult()
    missed: set[str] = set()
    for s in plan.stores:
        host, dev = ex.hosts[s.group], ex.caches[s.group]
        if s.group == ex.state:
            host.copy_slots_from(dev, s.device_pages, s.host_pages)
        else:
            host.copy_pages_from(dev, s.device_pages, s.host_pages)
        result.stores_done.append(s.id)
    if ex.disk is not None:
        if plan.stores and ex.data_is_cuda():     # the stores on host before they go to disk
            torch.cuda.current_stream(ex.cache.data.device).synchronize()
        missed = ex.disk.copies(
            plan, result, ex.hosts[0], ex.hosts[ex.state] if ex.state is not None
            else None, ex.hosts)
    for ld in plan.loads:
        host, dev = ex.hosts[ld.group], ex.caches[ld.group]
        if ld.group == ex.state:
            dev.copy_slots_from(host, ld.host_pages, ld.device_pages)
        else:
            dev.copy_pages_from(host, ld.host_pages, ld.device_pages)
        result.loads_done.append(ld.id)
    if (plan.stores or plan.loads) and ex.cache.data.is_cuda:
        # the copies are queued on the stream: done before they are acked
        torch.cuda.current_stream(ex.cache.data.device).synchronize()
    return result, missed
