"""`router:`: the router's limits (requests in flight, body size), who may
read its metrics, how often a stream sends, how many router processes
share its ports, and how long an engine may be silent before its requests
move."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.scheduler.config import ConfigError, check_keys, check_positive_int


@dataclass(frozen=True)
class RouterConfig:
    max_requests: int = 4096         # in flight at once; past it: HTTP 429 / RESOURCE_EXHAUSTED
    max_body_bytes: int = 8 << 20    # an HTTP body or gRPC message; past it: 413
    protect_metrics: bool = False    # with an API key, /health and /metrics need it too
    stream_interval: int = 1         # send a stream's tokens every k (1: token by token)
    replicas: int = 1                # router processes sharing the ports (SO_REUSEPORT)
    # an engine that has not answered healthy this long is silent; a request
    # that heard nothing this long from an unhealthy or silent engine moves
    engine_silent_s: float = 5.0

    @classmethod
    def from_dict(cls, data) -> "RouterConfig":
        data = check_keys(data, "router", {f.name for f in dataclasses.fields(cls)})
        cfg = cls(**data)
        for name in ("max_requests", "max_body_bytes", "stream_interval", "replicas"):
            check_positive_int(getattr(cfg, name), f"router.{name}")
        s = cfg.engine_silent_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
            raise ConfigError(f"router.engine_silent_s must be a number of seconds > 0 (how "
                              "long an engine may go without a healthy answer, or a request "
                              f"without a token from an unhealthy one, before it moves), got {s!r}")
        if not isinstance(cfg.protect_metrics, bool):
            raise ConfigError(f"router.protect_metrics must be true or false, "
                              f"got {cfg.protect_metrics!r}")
        return cfg
