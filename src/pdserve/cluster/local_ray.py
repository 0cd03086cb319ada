"""Start a Ray of our own on this machine.

Ray gives a new node 30 s to register with its GCS and then gives up
("The current node timed out during startup"), leaving the processes it
started behind; the GCS itself can be as late writing its port ("Timed out
waiting for file .../gcs_server_port_..."). On a small, busy host (two cores, a test suite) that
happens now and then with nothing wrong (in CI once a node timed out, and
the next start, beside the processes it left, timed out on the GCS port).
`init_local` and `start_retrying` kill what the failed start left and try
again, STARTUP_TRIES starts in all; the last failure is the caller's.
"""

from __future__ import annotations

import sys

import psutil
import ray

STARTUP_TRIES = 3


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_new(before: set[int]) -> None:
    procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def timed_out_at_startup(e: BaseException) -> bool:
    text = str(e)
    return "timed out during startup" in text or (
        "Timed out waiting for file" in text and "gcs_server_port" in text)


def init_local(**kwargs) -> None:
    """`ray.init(**kwargs)` for a local Ray, tried again (after killing the
    processes the failed start left) if the node times out at startup."""
    def undo():
        if ray.is_initialized():
            ray.shutdown()
    start_retrying(lambda: ray.init(**kwargs), undo)


def start_retrying(start, undo=lambda: None):
    """`start()` (a local Ray, or a `ray.cluster_utils.Cluster`), tried again
    up to STARTUP_TRIES times if a node times out at startup: `undo()`, then
    the processes the failed start left are killed. Returns what it returns."""
    for attempt in range(1, STARTUP_TRIES + 1):
        before = _children()
        try:
            return start()
        except Exception as e:
            if not timed_out_at_startup(e) or attempt == STARTUP_TRIES:
                raise
            print(f"pdserve: Ray's node timed out at startup ({e}); "
                  "starting it once more", file=sys.stderr, flush=True)
            undo()
            _kill_new(before)
