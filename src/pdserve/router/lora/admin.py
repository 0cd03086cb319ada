"""LoRA adapters loaded and unloaded while the deployment serves
(`POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`; off unless
`lora.runtime_updates`).

A load gets a new id from the router's registry and goes to every live
engine, P and D alike, before the router resolves the name: all or none
(an engine that fails has the others unload it again). An unload first
stops the router resolving the name (new requests under it are a 404),
then has every engine stop taking it and answer once the requests under it
have ended: streams under the adapter finish, then it is gone.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from pdserve.proto import control_pb2 as cpb
from pdserve.router.errors import ErrorKind, RequestError
from pdserve.scheduler.lora.adapters import AdapterNameError, AdapterRef

if TYPE_CHECKING:
    from pdserve.router.router import Router

LOAD_TIMEOUT_S = 120.0
UNLOAD_TIMEOUT_S = 600.0       # the streams under it finish first


def _check_enabled(r: Router) -> None:
    if not r.cfg.lora.runtime_updates:
        raise RequestError(ErrorKind.INVALID, "loading and unloading LoRA adapters at runtime "
                           "is off; set lora.runtime_updates: true in the config (or name "
                           "the adapters in lora.adapters)")


async def load(r: Router, name: str, path: str, pinned: bool = False) -> AdapterRef:
    """Load `path` as adapter `name` on every live engine (a name already
    loaded gets a new load: requests under the old one finish under it);
    `pinned`: never evicted from an engine's host memory or device slot."""
    _check_enabled(r)
    if not name or not path:
        raise RequestError(ErrorKind.INVALID, "give lora_name and lora_path", "lora_name")
    if name == r.model_name:
        raise RequestError(ErrorKind.INVALID, f"{name!r} is the base model's name; give the "
                           "adapter its own", "lora_name")
    adapter_id = r.adapters.next_id()
    engines = [e for e in r.engines.values() if e.alive and e.stub is not None]
    msg = cpb.AdapterRequest(name=name, path=path, id=adapter_id, pinned=pinned)
    old = r.adapters.get(name)
    # engines that (re)join meanwhile get it from the sync once it is registered
    r.adapter_sync.pending.add(adapter_id)
    if old is not None:
        r.adapter_sync.pending.add(old.id)
    try:
        return await _load_on(r, engines, msg, old)
    finally:
        r.adapter_sync.pending.discard(adapter_id)
        if old is not None:
            r.adapter_sync.pending.discard(old.id)


async def _load_on(r: Router, engines, msg, old: AdapterRef | None) -> AdapterRef:
    name, path, adapter_id = msg.name, msg.path, msg.id
    got = await asyncio.gather(*(e.control.LoadAdapter(msg, timeout=LOAD_TIMEOUT_S)
                                 for e in engines), return_exceptions=True)
    failed = [(e, g) for e, g in zip(engines, got) if isinstance(g, BaseException)]
    if failed:
        done = [e for e, g in zip(engines, got) if not isinstance(g, BaseException)]
        await asyncio.gather(*(e.control.UnloadAdapter(msg, timeout=LOAD_TIMEOUT_S)
                               for e in done), return_exceptions=True)
        e, err = failed[0]
        why = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        raise RequestError(ErrorKind.INVALID, f"adapter {name!r} from {path!r} was not "
                           f"loaded: {e.name}: {why}", "lora_path")
    try:
        ref = r.adapters.load(name, path, adapter_id, msg.pinned)
    except AdapterNameError as err:
        raise RequestError(ErrorKind.INVALID, str(err), "lora_name") from None
    for eng in engines:                   # the router sends its requests only where it is
        eng.adapters.add(adapter_id)
        if old is not None:
            eng.adapters.discard(old.id)
    return ref


async def unload(r: Router, name: str) -> AdapterRef:
    """Stop serving adapter `name`; returns once no request under it runs."""
    _check_enabled(r)
    ref = r.adapters.get(name)
    if ref is None:
        raise RequestError(ErrorKind.NOT_FOUND, r.adapters.unknown(name), "lora_name")
    r.adapters.unload(name)
    msg = cpb.AdapterRequest(name=name, path=ref.path, id=ref.id)
    engines = [e for e in r.engines.values() if e.alive and e.stub is not None]
    for e in r.engines.values():
        e.adapters.discard(ref.id)
    # an engine away now is unloaded by the sync when it answers again
    r.adapter_sync.pending.add(ref.id)
    try:
        got = await asyncio.gather(*(e.control.UnloadAdapter(msg, timeout=UNLOAD_TIMEOUT_S)
                                     for e in engines), return_exceptions=True)
    finally:
        r.adapter_sync.pending.discard(ref.id)
    for e, g in zip(engines, got):
        if isinstance(g, grpc.aio.AioRpcError) and g.code() != grpc.StatusCode.NOT_FOUND:
            raise RequestError(ErrorKind.UNAVAILABLE, f"adapter {name!r} is no longer served, "
                               f"but {e.name} did not confirm its unload: {g.details()}")
    return ref
