"""Membership's handling of an engine Ray reports gone (issue 53): a P that
died and is not back never sends the TransferEnded that frees what its D
peers hold for it, so the router tells them instead (RemovePeer), once per
incarnation, and only on Ray's word: a silent engine that Ray still has
alive (frozen, cut off) is only missed."""

import asyncio

import grpc

from pdserve.proto import control_pb2 as cpb
from pdserve.router.engines import membership
from pdserve.router.engines.membership import EngineGone
from pdserve.router.engines.pairing import EngineRef


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), "connection refused")


class FakeEngine:
    """An engine's control stub: answers GetInfo while `up`, records
    RemovePeer (failing the first `fail_removes`)."""

    def __init__(self, name: str, role: str, incarnation: int):
        self.name, self.role, self.incarnation = name, role, incarnation
        self.up, self.fail_removes = True, 0
        self.removed: list[tuple] = []

    async def GetInfo(self, request, timeout=None):
        if not self.up:
            raise unavailable()
        return cpb.InfoResponse(engine=self.name, role=self.role, incarnation=self.incarnation,
                                address=f"{self.name}:1")

    async def AddPeer(self, request, timeout=None):
        return cpb.Ack(ok=True)

    async def RemovePeer(self, request, timeout=None):
        if self.fail_removes:
            self.fail_removes -= 1
            raise unavailable()
        self.removed.append((request.engine, request.incarnation))
        return cpb.Ack(ok=True)


def deployment():
    """prefill-0@7, prefill-1@8 and decode-0@9, each known to the router."""
    engines = {}
    for name, role, inc in [("prefill-0", "prefill", 7), ("prefill-1", "prefill", 8),
                            ("decode-0", "decode", 9)]:
        ref = EngineRef(name, role, f"{name}:1")
        ref.stub = FakeEngine(name, role, inc)            # type: ignore[assignment]
        engines[name] = ref
    return engines


def refresh(engines, resolver):
    return asyncio.run(membership.refresh(engines, resolver))


def test_a_p_ray_reports_gone_is_down_at_once_and_its_d_peers_are_told_once():
    engines = deployment()
    refresh(engines, None)
    p, d = engines["prefill-0"], engines["decode-0"]
    p.stub.up = False

    def resolver(name):
        raise EngineGone(f"Ray reports {name}'s actor DEAD")

    d.stub.fail_removes = 1                       # the first try is lost: told again
    assert refresh(engines, resolver) is True
    assert not p.alive and engines["prefill-1"].alive and d.stub.removed == []
    refresh(engines, resolver)
    assert d.stub.removed == [("prefill-0", 7)]
    refresh(engines, resolver)
    assert d.stub.removed == [("prefill-0", 7)]    # once per incarnation
    assert engines["prefill-1"].stub.removed == []  # a P is not told about a P


def test_a_silent_engine_ray_still_has_alive_is_missed_not_reported_gone():
    engines = deployment()
    refresh(engines, None)
    p, d = engines["prefill-0"], engines["decode-0"]
    p.stub.up = False

    def resolver(name):                           # frozen: Ray's call to it times out
        raise TimeoutError(f"{name} did not answer")

    for _ in range(membership.MISSES_DOWN - 1):
        refresh(engines, resolver)
        assert p.alive
    refresh(engines, resolver)
    assert not p.alive and d.stub.removed == []


def test_a_gone_p_that_ray_brings_back_is_introduced_at_its_new_incarnation():
    engines = deployment()
    refresh(engines, None)
    p, d = engines["prefill-0"], engines["decode-0"]
    p.stub.up = False

    def resolver(name):
        raise EngineGone(f"Ray reports {name}'s actor RESTARTING")

    refresh(engines, resolver)
    assert d.stub.removed == [("prefill-0", 7)] and not p.alive
    p.stub.up, p.stub.incarnation = True, 10
    refresh(engines, resolver)
    assert p.alive and p.incarnation == 10 and d.stub.removed == [("prefill-0", 7)]
