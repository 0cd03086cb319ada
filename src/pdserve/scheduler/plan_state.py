"""The planner as its phases see it: `PlannerState`, what the round's
functions read and call of the `Planner` that passes itself in.

The phases (round/, cache/demands.py), retraction, the role grammars, overlap's
rules, the wait reasons and the invariants are plain functions of the
planner's state. They take it as a `PlannerState`, a Protocol naming
exactly what they use, so mypy follows every attribute they touch without
their importing planner.py (which imports them: the circle this breaks).
mypy checks `Planner` against it wherever the planner hands itself over.

`Ending` is kept here too: the record `PlannerState.ending` holds (overlap.py
owns its rules).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from pdserve.scheduler.lora.slots import AdapterSlots
from pdserve.scheduler.cache.groups import CacheGroupSpec
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.cache.coordinator import Coordinator
from pdserve.scheduler.cache.hit import HitCounts
from pdserve.scheduler.plan import Plan, StepResult
from pdserve.scheduler.request import Request


@dataclass(slots=True)
class Ending:
    """A request that ends once its forwards in flight land (overlap.py)."""
    req: Request
    reason: str
    aborted: bool


class PlannerState(Protocol):
    """What the round's functions read and call of the planner (planner.py
    says what each one means). They mutate the collections in place and
    rebind none of these."""

    cfg: EngineConfig
    groups: list[CacheGroupSpec]     # the model's cache groups, in the coordinator's order
    coord: Coordinator
    lora: AdapterSlots
    hits: HitCounts

    # the role's rules and the cache groups' bounds (capacity.group_bounds)
    page_size: int
    decodes_locally: bool
    decodes_use_budget: bool
    requeues_victims: bool
    speculating: bool
    replay_tokens: int
    prefix_tokens: int
    state_reserve: int
    min_prefill_tokens: int

    # the requests, by where their state puts them (submission order)
    waiting: deque[Request]
    prefilling: dict[str, Request]
    running: dict[str, Request]
    retracted: dict[str, Request]
    landing: dict[str, Request]
    transferring: dict[str, Request]
    requests: dict[str, Request]
    ending: dict[str, Ending]

    # transitions the phases ask for
    def prefill_completed(self, req: Request) -> None: ...
    def readmitted(self, req: Request) -> None: ...
    def retracted_from_device(self, req: Request) -> None: ...
    def take_slot(self, req: Request) -> None: ...
    def next_readmission(self) -> Request | None: ...
    def next_epoch(self) -> int: ...
    def record_stall(self, victim: Request | None) -> None: ...
    def waiting_on_peer(self) -> bool: ...

    # what overlap.py wraps: ending, applying and failing a round
    def abort(self, req_id: str, reason: str = ...) -> Request: ...
    def apply(self, plan: Plan, result: StepResult) -> list[Request]: ...
    def fail_plan(self, plan: Plan, reason: str) -> list[Request]: ...
    def _finish(self, req: Request, reason: str) -> None: ...
