"""What other processes on this machine use while a measurement runs:
calibration and `bench sim-accuracy` record it beside their figures, and
can wait for a quiet machine first."""

from __future__ import annotations

import os
import threading
import time


class ForeignLoad:
    """CPU (in cores) used by processes outside this one's tree, sampled
    from /proc while the block runs. None where /proc is not there."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.cores = None
        self._stop = threading.Event()

    def __enter__(self):
        if not os.path.exists("/proc/stat"):
            return self
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if hasattr(self, "_thread"):
            self._stop.set()
            self._thread.join()

    @staticmethod
    def _busy() -> int:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4]          # all but idle and iowait

    @staticmethod
    def _mine(root: int) -> int:
        parent, ticks = {}, {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(d)] = int(st[1])
            ticks[int(d)] = int(st[11]) + int(st[12])
        total = 0
        for pid, t in ticks.items():
            p = pid
            while p > 1 and p != root:
                p = parent.get(p, 0)
            if p == root:
                total += t
        return total

    def _watch(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        root = os.getpid()
        t0, b0, m0 = time.perf_counter(), self._busy(), self._mine(root)
        while not self._stop.wait(self.every_s):
            pass
        dt = time.perf_counter() - t0
        # children that ended during the block count as foreign (their
        # ticks left with them); a benchmark run keeps its processes alive
        self.cores = max(0.0, (self._busy() - b0 - (self._mine(root) - m0)) / hz / dt)  # type: ignore[assignment]


def wait_for_quiet(below: float, window_s: float = 5.0, timeout_s: float = 900.0) -> float | None:
    """Wait until other processes use less than `below` cores over a window
    (at most `timeout_s`); the last window's load (None without /proc)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with ForeignLoad() as load:
            time.sleep(window_s)
        if load.cores is None or load.cores < below or time.monotonic() > deadline:
            return load.cores
