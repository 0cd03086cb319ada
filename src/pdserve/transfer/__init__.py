"""KV movement between engines (P -> D), and the rules that make it safe.

    P: write(KvWrite)  --NIXL WRITE + notification-->  D: poll() -> landed
    P: poll() -> done | failed                         D: ack over the control plane

`KvTransport` is the contract; `NixlTransport` (one NIXL agent per engine
incarnation, UCX, the KV pool registered once, descriptors prepared once)
and `LoopbackTransport` (in-process, for unit tests) implement it.
`LandingTable` (D) fences landing pages a write may still reach;
`LeaseTable` (P) bounds how long a silent peer can keep pages pinned (a
write still running keeps them past it: `KvTransport.in_flight`);
`PeerTimeouts` (timeouts.py) holds the three timeouts and what they imply;
`FaultInjector` fails, delays or drops a transfer at a chosen stage.
"""

from pdserve.transfer.faults import FaultInjector, FaultRule
from pdserve.transfer.landing import LandingTable, LandingVerdict
from pdserve.transfer.lease import LeaseTable
from pdserve.transfer.timeouts import PeerTimeouts
from pdserve.transfer.transport import (
    Incarnation, KvTransport, KvWrite, TransferEvent, TransferEventKind, TransferMetrics,
    page_runs)

__all__ = ["FaultInjector", "FaultRule", "Incarnation", "KvTransport", "KvWrite",
           "LandingTable", "LandingVerdict", "LeaseTable", "PeerTimeouts", "TransferEvent", "TransferEventKind",
           "TransferMetrics", "page_runs"]
