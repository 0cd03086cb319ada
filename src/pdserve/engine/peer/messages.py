"""How an engine sends its peers control messages: which call (`PeerRpc`),
to whom (`Peer`: its address and stub), and off the loop thread
(`PeerSender`: a queue and a thread per peer, so a slow or frozen peer
never blocks a round, and never delays a message to another peer).

A call is named by its enum member, and the member maps to the stub's
method by attribute, not by a name looked up at send time: a misspelt call
fails where it is written.

Each peer's queue is bounded (`QUEUE_BOUND`) and sends in order, one call
at a time. A message waits at most `RPC_TIMEOUT_S` from the moment it is
queued until its call ends, so behind a peer that does not answer the
queue empties as fast as it fills. A message that cannot go reports it to
its sender's `on_error`, with a status code that says whether the peer may
have seen it:
  RESOURCE_EXHAUSTED   never sent: the queue was full, or its time ran out
                       while it waited behind earlier messages
  DEADLINE_EXCEEDED,   sent, and no answer came: the peer may have acted
  UNAVAILABLE, ...     on it (gRPC's own codes)
A heartbeat replaces the one still queued for the same peer (it names
everything the older one did that still matters), so a hung peer's queue
does not fill with heartbeats.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import threading
import time
from typing import Any, Callable

import grpc

from pdserve.proto import control_pb2_grpc as pbg

log = logging.getLogger("pdserve.engine")

RPC_TIMEOUT_S = 10.0
QUEUE_BOUND = 1024          # messages waiting for one peer; past it a new one is refused


class PeerRpc(enum.Enum):
    REMOTE_PREFILL = "RemotePrefill"      # D -> P: prefill this prompt and write it to me
    TRANSFER_ACK = "TransferAck"          # D -> P: landed (or no longer wanted): release
    TRANSFER_FAILED = "TransferFailed"    # P -> D: the write will not land
    LEASE_HEARTBEAT = "LeaseHeartbeat"    # D -> P: still waiting: renew the leases
    TRANSFER_ENDED = "TransferEnded"      # P -> D: no write of that landing is left

    def method(self, stub: pbg.EngineControlStub) -> Callable:
        """The stub's bound method for this call."""
        return _METHODS[self](stub)


_METHODS: dict[PeerRpc, Callable[[pbg.EngineControlStub], Callable]] = {
    PeerRpc.REMOTE_PREFILL: lambda stub: stub.RemotePrefill,
    PeerRpc.TRANSFER_ACK: lambda stub: stub.TransferAck,
    PeerRpc.TRANSFER_FAILED: lambda stub: stub.TransferFailed,
    PeerRpc.LEASE_HEARTBEAT: lambda stub: stub.LeaseHeartbeat,
    PeerRpc.TRANSFER_ENDED: lambda stub: stub.TransferEnded,
}


@dataclasses.dataclass
class Peer:
    name: str
    incarnation: int
    address: str
    stub: pbg.EngineControlStub | None


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """One message on a peer's queue."""
    peer: Peer
    rpc: PeerRpc
    request: Any
    on_error: Callable[[grpc.StatusCode], None] | None
    deadline: float              # time.monotonic(): its call must have ended by then


class PeerQueue:
    """The messages for one peer, sent in order by a thread of its own."""

    def __init__(self, sender: str, peer: str, bound: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.sender, self.peer = sender, peer
        self.bound, self.timeout_s = bound, timeout_s
        self.clock = clock
        self._items: collections.deque[Outgoing] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._flush = False          # closed: send what is queued first
        self._thread = threading.Thread(target=self._run, name=f"{sender}-to-{peer}",
                                        daemon=True)
        self._thread.start()

    def put(self, msg: Outgoing) -> bool:
        """Queue `msg`; False if the queue is full (or closed)."""
        with self._cv:
            if self._closed:
                return True                  # the engine stopped: nothing to report to
            if msg.rpc is PeerRpc.LEASE_HEARTBEAT:
                self._items = collections.deque(
                    m for m in self._items if m.rpc is not PeerRpc.LEASE_HEARTBEAT)
            if len(self._items) >= self.bound:
                return False
            self._items.append(msg)
            self._cv.notify()
            return True

    def __len__(self) -> int:
        with self._cv:
            return len(self._items)

    def close(self, flush: bool) -> None:
        with self._cv:
            self._closed, self._flush = True, flush
            if not flush:
                self._items.clear()
            self._cv.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._items or self._closed)
                if not self._items:
                    return
                msg = self._items.popleft()
            left = msg.deadline - self.clock()
            if left <= 0:                    # waited out its time behind earlier messages
                self.failed(msg, grpc.StatusCode.RESOURCE_EXHAUSTED)
                continue
            try:
                msg.rpc.method(msg.peer.stub)(msg.request, timeout=left)
            except grpc.RpcError as e:
                log.warning("%s -> %s %s failed: %s", self.sender, self.peer, msg.rpc.value,
                            e.code())
                self.failed(msg, e.code())
            except Exception:                # a bug must not end the peer's thread
                log.exception("%s -> %s %s", self.sender, self.peer, msg.rpc.value)

    def failed(self, msg: Outgoing, code: grpc.StatusCode) -> None:
        if msg.on_error is not None:
            try:
                msg.on_error(code)
            except Exception:
                log.exception("%s: on_error of %s to %s", self.sender, msg.rpc.value, self.peer)


class PeerSender:
    """Fires control messages off the loop thread, on a queue per peer; a
    failed call's status code goes to its `on_error` (on the peer's
    thread, or the caller's when its queue is full)."""

    def __init__(self, name: str, bound: int = QUEUE_BOUND, timeout_s: float = RPC_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.bound, self.timeout_s = bound, timeout_s
        self.clock = clock                   # what deadlines are read by (a test's, by hand)
        self._queues: dict[str, PeerQueue] = {}
        self._lock = threading.Lock()
        self._closed = False

    def queued(self, peer: str) -> int:
        """Messages waiting for `peer` (not counting one in its call)."""
        q = self._queues.get(peer)
        return len(q) if q is not None else 0

    def send(self, peer: Peer, rpc: PeerRpc, request, on_error=None,
             delay_s: float = 0.0) -> None:
        def submit():
            with self._lock:
                if self._closed:
                    return                   # the engine stopped meanwhile: nothing to send
                q = self._queues.get(peer.name)
                if q is None:
                    q = self._queues[peer.name] = PeerQueue(self.name, peer.name, self.bound,
                                                            self.timeout_s, self.clock)
            msg = Outgoing(peer, rpc, request, on_error, self.clock() + self.timeout_s)
            if not q.put(msg):
                log.warning("%s: %d messages wait for %s; %s not sent", self.name, q.bound,
                            peer.name, rpc.value)
                q.failed(msg, grpc.StatusCode.RESOURCE_EXHAUSTED)
        if delay_s:
            threading.Timer(delay_s, submit).start()
        else:
            submit()

    def close(self, wait: bool = False) -> None:
        """Stop sending; with `wait`, messages already queued go out first
        (each bounded by its deadline)."""
        with self._lock:
            self._closed = True
            queues = list(self._queues.values())
        for q in queues:
            q.close(flush=wait)
        if wait:
            for q in queues:
                q.join()
