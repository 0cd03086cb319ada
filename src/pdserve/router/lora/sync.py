"""Every live engine holds the router's LoRA adapter loads, including an
engine that restarted or joined after a runtime load or unload.

An engine starts with the configured adapters only. The router learns what
each engine holds from its GetInfo (`adapters`, as name:load id) on every
membership round (router/engines/membership.py calls `observe`):
- on a new incarnation (a restart, or a first answer), the engine's set of
  loads the router routes by (`EngineRef.adapters`) becomes exactly what it
  reports, before any request can be picked for it;
- a load the registry has and the engine lacks is sent to it
  (`LoadAdapter`, with its name, path, id and pin), and only once it is
  confirmed does the router send that adapter's requests there;
- a load the engine holds that the registry no longer has (unloaded or
  replaced while the engine was away) is unloaded there (`UnloadAdapter`).
A load or unload the admin API has in flight (router/lora/admin.py) is
left to it (`pending`). One replay per engine runs at a time, as a task on
the router's loop; a failed one is tried again on a later round.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from pdserve.proto import control_pb2 as cpb
from pdserve.router.engines.pairing import EngineRef
from pdserve.scheduler.lora.adapters import AdapterRegistry

log = logging.getLogger("pdserve.router")

REPLAY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class HeldLoad:
    """A load an engine says it holds."""
    name: str
    id: int


def held_loads(reported) -> list[HeldLoad]:
    """GetInfo's `adapters` ("name:id"; a name may itself hold colons)."""
    out = []
    for entry in reported:
        name, _, id_ = str(entry).rpartition(":")
        if name and id_.isdigit():
            out.append(HeldLoad(name, int(id_)))
    return out


class AdapterSync:
    def __init__(self, registry: AdapterRegistry):
        self.registry = registry
        self.pending: set[int] = set()       # load ids the admin API is loading or unloading
        self._tasks: dict[str, asyncio.Task] = {}
        self.replays = 0                     # loads and unloads sent by replay

    def observe(self, ref: EngineRef, info, new_incarnation: bool) -> None:
        """An answer from `ref` (on the router's loop): route by what it
        holds, and start a replay of what it lacks or should drop."""
        held = held_loads(info.adapters)
        ids = {h.id for h in held}
        if new_incarnation:
            ref.adapters = set(ids)
        want = {r.id: r for r in self.registry.refs()}
        missing = [r for i, r in want.items() if i not in ids and i not in self.pending]
        extra = [h for h in held if h.id not in want and h.id not in self.pending]
        if not (missing or extra):
            return
        task = self._tasks.get(ref.name)
        if task is not None and not task.done():
            return
        self._tasks[ref.name] = asyncio.get_running_loop().create_task(
            self._replay(ref, missing, extra))

    async def _replay(self, ref: EngineRef, missing, extra) -> None:
        for h in extra:
            try:
                await ref.control.UnloadAdapter(cpb.AdapterRequest(name=h.name, id=h.id),
                                                timeout=REPLAY_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    log.warning("unloading adapter %r (load %d) on %s failed: %s; retrying",
                                h.name, h.id, ref.name, e.details())
                    return
            ref.adapters.discard(h.id)
            self.replays += 1
        for r in missing:
            try:
                await ref.control.LoadAdapter(cpb.AdapterRequest(
                    name=r.name, path=r.path, id=r.id, pinned=r.pinned), timeout=REPLAY_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("loading adapter %r (load %d) on %s failed: %s; retrying",
                            r.name, r.id, ref.name, e.details())
                return
            if self.registry.by_id(r.id) is not None:    # not unloaded meanwhile
                ref.adapters.add(r.id)
            self.replays += 1
            log.info("%s: replayed adapter %r (load %d)", ref.name, r.name, r.id)

    async def settle(self) -> None:
        """Wait for the replays under way (tests, shutdown)."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def cancel(self) -> None:
        for t in self._tasks.values():
            t.cancel()
