"""`simulate:`: what `pdserve sim` models in place of the hardware: the GPU
and model (or a calibrated cost profile), the P -> D link, copy delays and
the disk tier's bandwidth (sim/)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.scheduler.config import ConfigError, check_keys


@dataclass(frozen=True)
class SimulateConfig:
    gpu: str = "h100"
    model: str = "llama-3-8b"
    link_gbps: float = 400.0         # P -> D KV link, per prefill engine
    link_latency_s: float = 0.0002   # one control message or RDMA completion
    lease_s: float = 10.0            # how long a silent peer can keep P's pages pinned
    # A model with sliding-window layers keeps only their window, in cache
    # groups of their own (pools: engine.total_pages, engine.sliding_pages);
    # false keeps every layer's whole history in one pool, as with a hybrid
    # allocator turned off. Attention reads only the window either way.
    sliding_groups: bool = True
    # a cost profile `pdserve calibrate` wrote, in place of gpu and model (a
    # relative path is read from the config file's folder)
    profile: str | None = None
    # rounds after its plan that each host load and store is acknowledged,
    # and rounds a decode engine runs after a transfer lands before it sees
    # it: an executor whose copies complete asynchronously (0: in the round)
    ack_delay_rounds: int = 0
    # the disk tier (engine.disk_cache): its read and write bandwidth, one
    # store per simulated node that every engine shares
    disk_read_gbps: float = 40.0      # ~5 GB/s: one local NVMe drive
    disk_write_gbps: float = 24.0     # ~3 GB/s

    @classmethod
    def from_dict(cls, data) -> "SimulateConfig":
        data = check_keys(data, "simulate", {f.name for f in dataclasses.fields(cls)})
        if data.get("profile") is not None:
            p = data["profile"]
            if not isinstance(p, str) or not p.strip():
                raise ConfigError(f"simulate.profile is {p!r}; give the path of a profile "
                                  "that `pdserve calibrate` wrote")
            both = [k for k in ("gpu", "model") if k in data]
            if both:
                raise ConfigError(f"simulate.profile replaces simulate.gpu and simulate.model "
                                  f"(the profile measured both); remove {' and '.join(both)}")
        cfg = cls(**data)
        if not isinstance(cfg.sliding_groups, bool):
            raise ConfigError(f"simulate.sliding_groups must be true or false, got "
                              f"{cfg.sliding_groups!r}")
        d = cfg.ack_delay_rounds
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ConfigError(f"simulate.ack_delay_rounds must be an integer >= 0 (rounds "
                              f"after its plan that a copy is acknowledged), got {d!r}")
        for name in ("link_gbps", "link_latency_s", "lease_s", "disk_read_gbps",
                     "disk_write_gbps"):
            v = getattr(cfg, name)
            positive = name in ("link_gbps", "disk_read_gbps", "disk_write_gbps")
            low = isinstance(v, (int, float)) and (0 < v if positive else 0 <= v)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not low:
                bound = "> 0" if positive else ">= 0"
                raise ConfigError(f"simulate.{name} must be a number {bound}, got {v!r}")
        return cfg
