"""Functions run as Ray tasks, one CPU each: how `pdserve plan` spreads its
probes over a cluster. Generic on purpose (it knows no simulator): the caller
puts what every task shares once and submits calls.

    tasks = RayTasks(address, cpus)
    shared = tasks.put(trace)
    handle = tasks.submit(run_probe, cfg, shared, factor, ...)
    tasks.result(handle)
"""

from __future__ import annotations

import logging

from pdserve.scheduler.config import ConfigError


class RayTasks:
    """A local Ray of our own with `cpus` CPUs, or the cluster at `address`."""

    def __init__(self, address: str | None, cpus: int):
        import ray

        from pdserve.cluster.local_ray import init_local

        self._ray = ray
        self._owned = not ray.is_initialized()
        if self._owned:
            try:
                # "local": a Ray of our own, never one another command started here
                start = ray.init if address else init_local
                start(address=address or "local", num_cpus=None if address else cpus,
                      include_dashboard=False, logging_level=logging.WARNING)
            except ConnectionError as e:
                raise ConfigError(f"--address {address}: no Ray cluster answered ({e}); "
                                  "give the head's address (ray status shows it) or "
                                  "leave --address out to use this machine") from None
        self._remote: dict = {}
        self.width = max(1, int(ray.cluster_resources().get("CPU", 1)))

    def put(self, value):
        """`value` stored once in the object store; pass the handle to submit."""
        return self._ray.put(value)

    def submit(self, fn, *args):
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(num_cpus=1)(fn)
        return remote.remote(*args)

    def result(self, handle):
        return self._ray.get(handle)

    def close(self) -> None:
        if self._owned:
            self._ray.shutdown()
