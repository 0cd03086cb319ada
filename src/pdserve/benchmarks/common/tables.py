"""Cells of the tables the benchmarks print, written alike wherever two
print the same kind of figure: a duration in ms or s (or "-" where there is
none), bytes in GB, a median with the range of the runs behind it, and the
nearest-rank percentile of a few samples."""

from __future__ import annotations

import statistics


def ms(v: float | None) -> str:
    """Seconds as whole milliseconds, "12ms"; "-" for None."""
    return f"{v * 1000:.0f}ms" if v is not None else "-"


def s_or_ms(v: float | None, unit_ms: bool = False) -> str:
    """Seconds as "1.23s", or with `unit_ms` as "12ms"; "-" for None."""
    if v is None:
        return "-"
    return f"{v * 1000:.0f}ms" if unit_ms else f"{v:.2f}s"


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def median_range(xs, spec: str = ".1f", unit: str = "", scale: float = 1.0) -> str:
    """"median unit (min-max)", each `scale`d and written as `spec`:
    median_range([0.1, 0.12], ",.0f", " ms", 1e3) is "110 ms (100-120)"."""
    m, lo, hi = (scale * v for v in (statistics.median(xs), min(xs), max(xs)))
    return f"{m:{spec}}{unit} ({lo:{spec}}-{hi:{spec}})"


def nearest_rank(xs, q: float) -> float:
    """The sample at rank int(q * n) of the sorted `xs` (the last for q
    near 1): a percentile of a few samples, none interpolated."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
