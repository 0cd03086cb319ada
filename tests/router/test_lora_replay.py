"""Runtime adapter loads and unloads reach engines that (re)join: the
router's membership round sees what an engine holds (GetInfo), routes by
exactly that after a restart, replays the loads it lacks and the unloads it
missed, and sends an adapter's requests there only once the load is
confirmed. Driven through membership.refresh with a fake engine."""

import asyncio

import grpc
import pytest

from pdserve.proto import control_pb2 as cpb
from pdserve.router.engines import membership
from pdserve.router.lora.sync import AdapterSync, held_loads
from pdserve.router.engines.pairing import EngineRef, Pairing
from pdserve.scheduler.lora.adapters import AdapterRegistry


def not_found(what: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), what)


class FakeEngine:
    """An engine's control stub: holds loads by name, answers GetInfo."""

    def __init__(self, held: dict, incarnation: int):
        self.held, self.incarnation = dict(held), incarnation
        self.calls: list[tuple] = []
        self.gate = asyncio.Event()          # a LoadAdapter answers once set
        self.gate.set()
        self.fail_loads = 0

    async def GetInfo(self, request, timeout=None):
        return cpb.InfoResponse(engine="fused-0", role="fused", incarnation=self.incarnation,
                                adapters=[f"{n}:{i}" for n, i in self.held.items()])

    async def LoadAdapter(self, request, timeout=None):
        self.calls.append(("load", request.name, request.id, request.pinned))
        await self.gate.wait()
        if self.fail_loads:
            self.fail_loads -= 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "no such directory")
        self.held[request.name] = request.id
        return cpb.Ack(ok=True)

    async def UnloadAdapter(self, request, timeout=None):
        self.calls.append(("unload", request.name, request.id))
        if self.held.get(request.name) != request.id:
            raise not_found(f"holds no {request.name} (load {request.id})")
        del self.held[request.name]
        return cpb.Ack(ok=True)


def deployment(held: dict, incarnation: int = 7):
    """A router's registry after runtime updates: A configured (load 1) and
    reloaded (load 3), B loaded pinned (load 2); one engine holding `held`."""
    reg = AdapterRegistry.from_config({"A": "/a"}, "base")
    reg.load("B", "/b", 2, pinned=True)
    reg.load("A", "/a2", 3)
    ref = EngineRef("fused-0", "fused", "x", adapters={1, 2, 3})
    ref.stub = FakeEngine(held, incarnation)             # type: ignore[assignment]
    return reg, AdapterSync(reg), ref, {"fused-0": ref}


async def _round(engines, sync):
    await membership.refresh(engines, on_info=sync.observe)


def test_a_restarted_engine_gets_the_runtime_loads_before_their_requests():
    async def run():
        reg, sync, ref, engines = deployment({"A": 1})   # restarted: the configured A only
        pairing = Pairing(engines, 4)
        ref.stub.gate.clear()
        await _round(engines, sync)
        # routed by what it holds now: neither A's new load nor B until confirmed
        assert ref.alive and ref.adapters == {1}
        for load in (2, 3):
            with pytest.raises(LookupError, match=f"load {load}"):
                pairing.pick("", [1], adapter=load)
        ref.stub.gate.set()
        await sync.settle()
        assert ref.stub.calls == [("unload", "A", 1), ("load", "B", 2, True),
                                  ("load", "A", 3, False)]       # oldest load first
        assert ref.adapters == {2, 3} and ref.stub.held == {"A": 3, "B": 2}
        assert pairing.pick("", [1], adapter=2)[0] is ref
        await _round(engines, sync)                       # in step: nothing more sent
        await sync.settle()
        assert len(ref.stub.calls) == 3 and sync.replays == 3
    asyncio.run(run())


def test_an_unload_missed_while_away_is_replayed():
    async def run():
        reg, sync, ref, engines = deployment({"A": 3, "B": 2}, incarnation=5)
        ref.incarnation = 5                               # the same process, back
        reg.unload("B")
        await _round(engines, sync)
        await sync.settle()
        assert ref.stub.calls == [("unload", "B", 2)] and 2 not in ref.adapters
    asyncio.run(run())


def test_loads_the_admin_api_has_in_flight_are_left_to_it():
    async def run():
        reg, sync, ref, engines = deployment({"A": 3, "B": 2})
        reg.load("C", "/c", 4)
        sync.pending.add(4)
        await _round(engines, sync)
        await sync.settle()
        assert ref.stub.calls == [] and ref.adapters == {2, 3}
    asyncio.run(run())


def test_a_failed_replay_is_tried_again_on_a_later_round():
    async def run():
        reg, sync, ref, engines = deployment({"A": 3})
        ref.stub.fail_loads = 1
        await _round(engines, sync)
        await sync.settle()
        assert ref.adapters == {3}                        # B not confirmed: not routed there
        await _round(engines, sync)
        await sync.settle()
        assert ref.adapters == {2, 3}
        assert [c[:3] for c in ref.stub.calls] == [("load", "B", 2)] * 2
    asyncio.run(run())


def test_held_loads_read_names_with_colons():
    assert [(h.name, h.id) for h in held_loads(["org/m:v2:7", "bad", "x:"])] == [("org/m:v2", 7)]
