"""`autoscale:`: the bounds and targets the autoscaler keeps
(cluster/autoscale_policy.py reads them; docs/operations.md, "Autoscaling P and D")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.scheduler.config import ConfigError, check_keys, check_positive_int


# the autoscaler's settings (cluster/autoscale_policy.py reads them)
@dataclass(frozen=True)
class RoleBounds:
    min: int = 1
    max: int = 1


@dataclass(frozen=True)
class AutoscaleConfig:
    prefill: RoleBounds = RoleBounds()
    decode: RoleBounds = RoleBounds()
    ttft_s: float = 2.0              # TTFT p95 target
    itl_s: float = 0.2               # inter-token latency p95 target
    interval_s: float = 5.0          # how often the actor looks
    cooldown_s: float = 30.0         # after an action, before the next
    scale_down_after_s: float = 60.0  # calm this long before an engine comes off
    kv_high: float = 0.85            # D's pages used that asks for another D
    low_water: float = 0.5           # survivors' pool share a removal may leave them at
    queue_high: int = 4              # requests queued for a role that ask for another
    drain_deadline_s: float = 120.0  # an engine coming off finishes its work within this

    @classmethod
    def from_dict(cls, data) -> "AutoscaleConfig":
        data = dict(check_keys(data, "autoscale", {f.name for f in dataclasses.fields(cls)}))
        for role in ("prefill", "decode"):
            if role in data:
                b = check_keys(data[role], f"autoscale.{role}", {"min", "max"})
                data[role] = RoleBounds(**b)
        cfg = cls(**data)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for role in ("prefill", "decode"):
            b = getattr(self, role)
            for k in ("min", "max"):
                check_positive_int(getattr(b, k), f"autoscale.{role}.{k}")
            if b.min > b.max:
                raise ConfigError(f"autoscale.{role}: min {b.min} is above max {b.max}; "
                                  "make min <= max")
        for k in ("ttft_s", "itl_s", "interval_s", "cooldown_s", "scale_down_after_s",
                  "drain_deadline_s"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"autoscale.{k} must be a number > 0, got {v!r}")
        check_positive_int(self.queue_high, "autoscale.queue_high")
        for k in ("kv_high", "low_water"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ConfigError(f"autoscale.{k} must be in (0, 1], got {v!r}")

    def bounds(self, role: str) -> RoleBounds:
        return getattr(self, role)
