"""How an engine sends its peers control messages: which call (`PeerRpc`),
to whom (`Peer`: its address and stub), and off the loop thread
(`PeerSender`: a small pool, so a slow peer never blocks a round).

A call is named by its enum member, and the member maps to the stub's
method by attribute, not by a name looked up at send time: a misspelt call
fails where it is written.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import enum
import logging
import threading
from typing import Callable

import grpc

from pdserve.proto import control_pb2_grpc as pbg

log = logging.getLogger("pdserve.engine")

RPC_TIMEOUT_S = 10.0


class PeerRpc(enum.Enum):
    REMOTE_PREFILL = "RemotePrefill"      # D -> P: prefill this prompt and write it to me
    TRANSFER_ACK = "TransferAck"          # D -> P: landed (or no longer wanted): release
    TRANSFER_FAILED = "TransferFailed"    # P -> D: the write will not land
    LEASE_HEARTBEAT = "LeaseHeartbeat"    # D -> P: still waiting: renew the leases

    def method(self, stub: pbg.EngineControlStub) -> Callable:
        """The stub's bound method for this call."""
        return _METHODS[self](stub)


_METHODS: dict[PeerRpc, Callable[[pbg.EngineControlStub], Callable]] = {
    PeerRpc.REMOTE_PREFILL: lambda stub: stub.RemotePrefill,
    PeerRpc.TRANSFER_ACK: lambda stub: stub.TransferAck,
    PeerRpc.TRANSFER_FAILED: lambda stub: stub.TransferFailed,
    PeerRpc.LEASE_HEARTBEAT: lambda stub: stub.LeaseHeartbeat,
}


@dataclasses.dataclass
class Peer:
    name: str
    incarnation: int
    address: str
    stub: pbg.EngineControlStub | None


class PeerSender:
    """Fires control messages off the loop thread; a failed call's status
    code goes to its `on_error` (on the sending thread)."""

    def __init__(self, name: str, workers: int = 8):
        self.name = name
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix=f"{name}-rpc")

    def send(self, peer: Peer, rpc: PeerRpc, request, on_error=None,
             delay_s: float = 0.0) -> None:
        call = rpc.method(peer.stub)

        def go():
            try:
                call(request, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as e:
                log.warning("%s -> %s %s failed: %s", self.name, peer.name, rpc.value, e.code())
                if on_error is not None:
                    on_error(e.code())

        def submit():
            try:
                self._pool.submit(go)
            except RuntimeError:            # the engine stopped meanwhile: nothing to send
                pass
        if delay_s:
            threading.Timer(delay_s, submit).start()
        else:
            submit()

    def close(self, wait: bool = False) -> None:
        """Stop sending; with `wait`, messages already queued go out first
        (each bounded by its RPC timeout)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
