"""Role grammars: each role's round is a readable sequence of phases (§3).

Fused, mixed (§3.3): decodes first (a client is streaming them, and a long
prefill chunk must not starve them), then the local-prefill phases spend
what budget remains: the readmission first (it holds a host snapshot other
admissions could evict), resident chunks, new prompts; then retraction.

Fused, non-mixed: the prefill phases run first and alone; decodes get the
round only when no prefill was scheduled; then retraction.

P (§3.1): completed prompts out on remote_decode, then resident chunks, then
new prompts. No retraction: P's pressure valve is the transfer itself.

D (§3.2): local recovery alone in its batch (a resident recovery chunk, else
the one readmission); otherwise the decode batch (no token budget), at most
one remote admission beside it, then retraction.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from pdserve.scheduler.round.build import PlanBuild
from pdserve.scheduler.round.decode import decode_phase
from pdserve.scheduler.round.prefill import (
    new_prompt_phase, readmission_phase, resident_prefill_phase)
from pdserve.scheduler.round.remote import (
    local_recovery_phase, remote_admission_phase, ship_phase)
from pdserve.scheduler.plan_state import PlannerState
from pdserve.scheduler.round.retraction import maybe_retract_for_capacity


class Role(enum.Enum):
    FUSED = "fused"
    PREFILL = "prefill"
    DECODE = "decode"


def fused_mixed(p: PlannerState, b: PlanBuild) -> None:
    decode_phase(p, b)
    readmission_phase(p, b)
    resident_prefill_phase(p, b)
    new_prompt_phase(p, b)
    maybe_retract_for_capacity(p, b)


def fused_non_mixed(p: PlannerState, b: PlanBuild) -> None:
    readmission_phase(p, b)
    resident_prefill_phase(p, b)
    new_prompt_phase(p, b)
    if not b.plan.prefills:
        decode_phase(p, b)
    maybe_retract_for_capacity(p, b)


def prefill_worker(p: PlannerState, b: PlanBuild) -> None:
    ship_phase(p, b)
    resident_prefill_phase(p, b)
    new_prompt_phase(p, b)


def decode_worker(p: PlannerState, b: PlanBuild) -> None:
    if local_recovery_phase(p, b):
        return
    decode_phase(p, b)
    remote_admission_phase(p, b)
    maybe_retract_for_capacity(p, b)


def grammar_for(role: Role, mixed: bool) -> Callable[[PlannerState, PlanBuild], None]:
    if role is Role.FUSED:
        return fused_mixed if mixed else fused_non_mixed
    if role is Role.PREFILL:
        return prefill_worker
    return decode_worker
