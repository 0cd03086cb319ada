"""One started deployment for a test module: each module that needs a
cluster shares one, started once (Ray's start is the slow part)."""

from __future__ import annotations

import contextlib

from pdserve.config import ServeConfig
from pdserve.cluster.deploy import Deployment


@contextlib.contextmanager
def deployed(cfg: dict, http_port: int | None = None, **options):
    """`cfg` (a config dict) started as a Deployment on 2 CPUs, `options`
    going to Deployment; stopped on exit. An engine that served on after a
    round it failed fails the module."""
    dep = Deployment(ServeConfig.from_dict(cfg), num_cpus=2, **options)
    dep.start(http_port=http_port)
    yield dep
    errors = dep.errors()
    dep.stop()
    assert not errors, f"engines served on after failing rounds: {errors}"


def by_name(client) -> dict[str, dict]:
    """Each engine's stats (`Client.stats()`) by its name, without "pdserve:"."""
    return {s["name"].removeprefix("pdserve:"): s for s in client.stats()}


def engine_channel(dep: Deployment, name: str):
    """A channel to engine `name` (`role-index`) as the deployment's own
    parties reach it: at the address operators' stats give, with a leaf the
    deployment's CA issued (plaintext on an insecure control plane)."""
    from pdserve.proto.control_tls import channel

    tls = dep.control.for_party("test") if dep.control is not None else None
    return channel(dep.router.engines[name.removeprefix("pdserve:")].address, tls)
