"""Role grammars: each role's round is a readable sequence of phases (§3).

Fused, mixed (§3.3): decodes first (a client is streaming them, and a long
prefill chunk must not starve them), then the local-prefill phases spend
what budget remains: the readmission first (it holds a host snapshot other
admissions could evict), resident chunks, new prompts; then retraction.

Fused, non-mixed: the prefill phases run first and alone; decodes get the
round only when no prefill was scheduled; then retraction.
"""

from __future__ import annotations

import enum

from pdserve.scheduler.phases import (
    PlanBuild, decode_phase, new_prompt_phase, readmission_phase, resident_prefill_phase)
from pdserve.scheduler.retraction import maybe_retract_for_capacity


class Role(enum.Enum):
    FUSED = "fused"


def fused_mixed(p, b: PlanBuild) -> None:
    decode_phase(p, b)
    readmission_phase(p, b)
    resident_prefill_phase(p, b)
    new_prompt_phase(p, b)
    maybe_retract_for_capacity(p, b)


def fused_non_mixed(p, b: PlanBuild) -> None:
    readmission_phase(p, b)
    resident_prefill_phase(p, b)
    new_prompt_phase(p, b)
    if not b.plan.prefills:
        decode_phase(p, b)
    maybe_retract_for_capacity(p, b)


def grammar_for(role: Role, mixed: bool):
    if role is Role.FUSED:
        return fused_mixed if mixed else fused_non_mixed
    raise ValueError(f"no grammar for role {role}")
