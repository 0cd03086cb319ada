"""The router served: its gRPC front and, given a port for it, its OpenAI
HTTP front, opened on the router's loop. What hosts a router calls this
(cluster/deploy.py, cluster/actors.RouterHost); it is the one module that
imports both the router and its fronts, so the fronts import the router and
the router imports neither."""

from __future__ import annotations

from pdserve.router.grpc_api import GrpcServer
from pdserve.router.http_api import HttpServer
from pdserve.router.router import Front, Router


def serve(router: Router, host: str = "127.0.0.1", port: int = 0,
          http_port: int | None = None, watch_s: float = 1.0) -> str:
    """Start `router` serving gRPC on `port` (and HTTP on `http_port`) from
    a thread of its own; returns the gRPC address once both are bound.
    Their addresses are `router.address` and `router.http_address`;
    `router.stop()` closes them."""
    grpc_front = GrpcServer(host, port)
    http_front = HttpServer(host, http_port) if http_port is not None else None
    fronts: list[Front] = [grpc_front] if http_front is None else [grpc_front, http_front]
    router.start(fronts, watch_s)
    address = grpc_front.address
    assert address is not None                  # set by open(), which start() waited for
    router.address = address
    router.http_address = http_front.address if http_front is not None else None
    return address
