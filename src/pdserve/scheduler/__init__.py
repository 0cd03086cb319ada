"""The planner every engine runs: pure, deterministic, stdlib only.

Data flows one way through a round. `Planner.build()` walks the role's
grammar (a sequence of phases over one FIFO candidate order), asks the
`Coordinator` to admit each chunk or decode page against the `PagePool` and
its `PrefixIndex` (claiming the prefix hit `hit.py` finds, and queueing the
host tier's stores and loads in `host_tier.py`), moves requests through the
FSM in `fsm.py`, and returns a `Plan`. The engine carries the plan out and
hands the `StepResult` back to `Planner.apply()`, which lands tokens, acks
copies, finishes requests and releases pages; `invariants.py` checks that
nothing leaked. Nothing here reads a clock, does I/O or draws a random number.
"""

from pdserve.scheduler.config import ConfigError, EngineConfig
from pdserve.scheduler.plan import Plan, PrefillOp, StepResult
from pdserve.scheduler.planner import Planner, RejectedRequest
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.scheduler.round.waiting import Hold, WaitReason

__all__ = [
    "ConfigError",
    "EngineConfig",
    "Hold",
    "Plan",
    "Planner",
    "PrefillOp",
    "RejectedRequest",
    "Request",
    "SamplingLimits",
    "StepResult",
    "WaitReason",
]
