"""Clocks the benchmarks share: the median of a call timed between two
syncs, two calls timed in alternation (so a drift of a shared host hits
both alike), and the time an object's method takes, counted by wrapping it
on that instance."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, rounds: int, sync) -> float:
    """The median of `rounds` calls of `fn`, in ms, each between two `sync`s."""
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def alternating(a, b, repeats: int) -> tuple[list[float], list[float]]:
    """Each of `a` and `b` called once untimed (their first call's costs),
    then `repeats` times in turn, a first: the seconds of each call."""
    a(), b()
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(repeats):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return ta, tb


class MethodClock:
    """The seconds `obj.name(...)` took since the last `reset`: the method
    is wrapped on this one instance (its class is untouched)."""

    def __init__(self, obj, name: str):
        self.seconds = 0.0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(obj, name, timed)

    def reset(self) -> None:
        self.seconds = 0.0
