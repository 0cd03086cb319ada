"""A NIXL agent as pdserve builds one, for an engine's transport
(nixl_transport.py) and for each tensor-parallel rank (rank_agent.py)."""

from __future__ import annotations

import threading

PROGRESS_WAKE_US = 10_000     # the progress thread's longest sleep between UCX events
_SWAP_LOCK = threading.Lock()


def new_agent(name: str, backends, telemetry: bool, progress_wake_us: int | None):
    """A NIXL agent. With `progress_wake_us`, its UCX backend runs a progress
    thread that sleeps in poll() on the workers' event fds and wakes on
    traffic, or after that many microseconds at most. NIXL's Python API
    hard-codes the sleep to 0 (`nixl_agent.__init__` sets `pthrDelay = 0`),
    which makes the same thread spin a core; the config class is swapped for
    one that keeps our value while the agent is built."""
    import nixl._api as api

    conf = api.nixl_agent_config(enable_prog_thread=progress_wake_us is not None,
                                 backends=list(backends), capture_telemetry=telemetry)
    if progress_wake_us is None:
        return api.nixl_agent(name, conf)
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key, value):
            base.__setattr__(self, key, max(value, progress_wake_us) if key == "pthrDelay"
                             else value)
    with _SWAP_LOCK:
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgentConfig = base
