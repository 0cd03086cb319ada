"""Membership: which engines are alive, at which incarnation, and each P
and D told about the others (address and NIXL metadata), again whenever one
restarts. Runs on the router's event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import grpc

from pdserve.proto.control_tls import ControlTls, aio_channel
from pdserve.router.engines.pairing import EngineRef
from pdserve.proto import control_pb2 as cpb
from pdserve.proto import control_pb2_grpc as cpbg

log = logging.getLogger("pdserve.router")

# an engine that misses this many GetInfo rounds in a row is taken as down; a
# broken event stream (engine_link.py) says so at once. A loaded machine can
# delay one answer past its timeout without the engine being gone.
MISSES_DOWN = 3


class EngineGone(Exception):
    """What a resolver raises when Ray reports the engine's actor dead or
    restarting: the incarnation the router knew has ended and writes no
    KV any more (a frozen or cut-off process is not gone: Ray still has
    it alive)."""


GONE = object()     # _info's answer for an engine its resolver reports gone


@dataclasses.dataclass(frozen=True)
class Dial:
    """How the router reaches its engines: the channels' options, and the
    router's credentials on the control plane (None: plaintext)."""
    options: tuple = ()
    tls: ControlTls | None = None


def connect(ref: EngineRef, address: str, dial: Dial = Dial()):
    """Point `ref` at `address` on a fresh channel (on the running loop);
    returns the channel it used before, if any, for the caller to close."""
    old = ref.channel
    ref.address = address
    ref.channel = aio_channel(address, dial.tls, dial.options)
    ref.stub = cpbg.EngineControlStub(ref.channel)
    return old


async def disconnect(ref: EngineRef) -> None:
    """Close `ref`'s channel, cancelling what is still in flight on it: a
    channel left open past its loop delivers its last completions to a
    closed loop."""
    channel, ref.channel = ref.channel, None
    if channel is not None:
        await channel.close()


async def _info(ref: EngineRef, resolver, dial: Dial):
    try:
        return await ref.control.GetInfo(cpb.InfoRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        pass
    address = None
    if resolver is not None:
        try:          # Ray's restart may have moved it: ask where it is now
            address = await asyncio.get_running_loop().run_in_executor(None, resolver, ref.name)
        except EngineGone:
            return GONE
        except Exception:                     # not back yet: try again next round
            address = None
    if address is None or address == ref.address:
        return None
    moved_from = connect(ref, address, dial)
    if moved_from is not None:              # the old address serves nothing now
        await moved_from.close()
    try:
        return await ref.control.GetInfo(cpb.InfoRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return None


async def refresh(engines: dict[str, EngineRef], resolver=None, dial: Dial = Dial(),
                  on_info: Callable[[EngineRef, Any, bool], None] | None = None) -> bool:
    """Ask every engine who it is; introduce P and D peers to each other
    whenever an incarnation is new. `on_info(ref, info, new incarnation)`:
    called for each answer as it is taken in, before anything else runs on
    the loop (the router's adapter sync, router/lora/sync.py). Returns
    whether anything changed."""
    refs = list(engines.values())
    got = await asyncio.gather(*(_info(r, resolver, dial) for r in refs))
    changed, infos = False, {}
    for ref, info in zip(refs, got):
        if info is GONE:
            changed |= ref.alive
            ref.alive, ref.misses = False, MISSES_DOWN
            continue
        if info is None:
            ref.misses += 1
            if ref.misses >= MISSES_DOWN:
                changed |= ref.alive
                ref.alive = False
            continue
        ref.misses = 0
        ref.alive = True
        ref.kv_capacity_tokens = info.kv_capacity_tokens
        infos[ref.name] = info
        if info.incarnation != ref.incarnation:
            ref.incarnation = info.incarnation
            ref.draining = info.draining          # a new incarnation serves afresh
            # its answer is a healthy answer: the old process's silence is not its own
            ref.unhealthy = info.unhealthy
            if not info.unhealthy:
                ref.healthy_at = asyncio.get_running_loop().time()
            changed = True
            new = True
        else:       # never undone by an answer sent before the engine heard the drain
            ref.draining |= info.draining
            new = False
        if on_info is not None:
            on_info(ref, info, new)
    if changed:
        calls, told = [], []
        for a in refs:
            for b in refs:
                if a is b or not (a.alive and b.alive) or {a.role, b.role} != {"prefill", "decode"}:
                    continue
                i = infos[b.name]
                told.append(a)
                calls.append(a.control.AddPeer(cpb.AddPeerRequest(
                    engine=b.name, incarnation=i.incarnation, nixl_metadata=i.nixl_metadata,
                    address=i.address, spec_config=i.spec_config), timeout=30))
        for a, res in zip(told, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(res, Exception):
                log.warning("telling %s about its peers failed: %s; retrying", a.name, res)
                a.incarnation = 0             # seen as new next round: introduced again
    await _tell_gone([r for r, info in zip(refs, got) if info is GONE], refs)
    return changed


async def _tell_gone(gone: list[EngineRef], refs: list[EngineRef]) -> None:
    """Tell each live engine of the other role (P for D, D for P) that a
    gone engine's incarnation ended: D's landings asked of it come back,
    which nothing else would do for a P that never returns. Once per
    incarnation; a peer that missed it is told again next round."""
    for ref in gone:
        if not ref.incarnation or ref.removed == ref.incarnation:
            continue
        peers = [e for e in refs if e.alive and {e.role, ref.role} == {"prefill", "decode"}]
        res = await asyncio.gather(*(e.control.RemovePeer(cpb.RemovePeerRequest(
            engine=ref.name, incarnation=ref.incarnation), timeout=30) for e in peers),
            return_exceptions=True)
        failed = [e.name for e, r in zip(peers, res) if isinstance(r, Exception)]
        if failed:
            log.warning("telling %s that %s is gone failed; retrying", failed, ref.name)
        else:
            log.warning("%s (incarnation %d) is gone: told %d peers", ref.name,
                        ref.incarnation, len(peers))
            ref.removed = ref.incarnation
