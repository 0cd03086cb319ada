"""`cluster:`: how many engines of each role a deployment runs, and each
role's tensor-parallel size, checked against the engine section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.scheduler.config import (
    ConfigError, EngineConfig, check_keys, check_tensor_parallel)


@dataclass(frozen=True)
class ClusterShape:
    prefill: int = 1
    decode: int = 1
    fused: int = 0
    # (role, tensor_parallel_size) for the roles whose count was given as
    # {count: N, tensor_parallel_size: T}; the others run engine.tensor_parallel_size
    tensor_parallel: tuple = ()

    @classmethod
    def from_dict(cls, data) -> "ClusterShape":
        """No `cluster:` section: 1P+1D. A given mapping names every engine
        there is: `{fused: 2}` is two fused engines and nothing else. A
        role's count may be `{count: N, tensor_parallel_size: T}`."""
        if data is None:
            return cls()
        data = dict(check_keys(data, "cluster", {"prefill", "decode", "fused"}))
        tp = []
        for role, v in data.items():
            if isinstance(v, dict):
                v = check_keys(v, f"cluster.{role}", {"count", "tensor_parallel_size"})
                if "count" not in v:
                    raise ConfigError(f"cluster.{role} is a mapping without count; give "
                                      f"{{count: N, tensor_parallel_size: T}}")
                data[role] = v["count"]
                if "tensor_parallel_size" in v:
                    tp.append((role, v["tensor_parallel_size"]))
        shape = cls(**{"prefill": 0, "decode": 0, "fused": 0, **data}, tensor_parallel=tuple(tp))
        for name in ("prefill", "decode", "fused"):
            v = getattr(shape, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"cluster.{name} must be an integer >= 0, got {v!r}")
        for role, t in shape.tensor_parallel:
            if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                raise ConfigError(f"cluster.{role}.tensor_parallel_size must be an integer "
                                  f">= 1, got {t!r}")
        if shape.fused == 0 and (shape.prefill == 0 or shape.decode == 0):
            raise ConfigError(
                f"cluster has prefill={shape.prefill}, decode={shape.decode}, fused=0: "
                "nothing could serve a request end to end; give at least one fused "
                "engine, or at least one prefill and one decode engine")
        return shape

    def tp_size(self, role: str, default: int = 1) -> int:
        """The tensor-parallel size of `role`'s engines (`default`: the engine section's)."""
        return dict(self.tensor_parallel).get(role, default)


def check_cluster_tp(engine: EngineConfig, cluster: ClusterShape) -> None:
    """Each role's engine settings at its tensor-parallel size (what a
    tensor-parallel engine does not run is refused by name, scheduler/config.py).
    Prefill and decode engines of any sizes pair (KV moved rank to rank: engine/tp/transfer.py)."""
    for role in ("fused", "prefill", "decode"):
        if not getattr(cluster, role):
            continue
        t = cluster.tp_size(role, engine.tensor_parallel_size)
        check_tensor_parallel(dataclasses.replace(engine, tensor_parallel_size=t),
                              f"cluster.{role}")
