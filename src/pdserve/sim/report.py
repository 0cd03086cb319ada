"""What `pdserve sim` reports: per-request records, the summary, goodput;
the SLO a request meets, and a watch that ends a run once too many miss it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Record:
    id: str
    arrival_s: float
    status: str = "unfinished"
    error: str | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    output_tokens: int = 0
    retractions: int = 0

    def to_json(self) -> dict:
        ttft = e2e = tpot = None
        if self.first_token_s is not None:
            ttft = self.first_token_s - self.arrival_s
        if self.finish_s is not None and self.status == "finished":
            e2e = self.finish_s - self.arrival_s
            if self.output_tokens > 1:
                tpot = (self.finish_s - self.first_token_s) / (self.output_tokens - 1)  # type: ignore[operator]
        return {"id": self.id, "status": self.status, "error": self.error,
                "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e,
                "output_tokens": self.output_tokens, "retractions": self.retractions}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(rows: list[dict], virtual_seconds: float) -> dict:
    fin = [r for r in rows if r["status"] == "finished"]
    out_tokens = sum(r["output_tokens"] for r in fin)
    ttft = [r["ttft_s"] for r in fin]
    tpot = [r["tpot_s"] for r in fin if r["tpot_s"] is not None]
    summary: dict[str, object] = {s: sum(1 for r in rows if r["status"] == s)
               for s in ("finished", "rejected", "failed", "unfinished")}
    summary.update({
        "virtual_seconds": virtual_seconds,
        "output_tok_per_s": out_tokens / virtual_seconds if virtual_seconds > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
    })
    return summary


@dataclass(frozen=True)
class Slo:
    """Latency targets a request meets only together (DistServe counts a
    request as served when both hold)."""
    ttft_s: float
    tpot_s: float

    def met(self, row: dict) -> bool:
        """`row`: a request of the result JSON (`Record.to_json`)."""
        return (row["status"] == "finished" and row["ttft_s"] <= self.ttft_s
                and (row["tpot_s"] is None or row["tpot_s"] <= self.tpot_s))


def goodput(result: dict, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Finished requests a second that met both SLOs (DistServe's goodput)."""
    slo = Slo(ttft_slo_s, tpot_slo_s)
    ok = sum(1 for r in result["requests"] if slo.met(r))
    secs = result["summary"]["virtual_seconds"]
    return ok / secs if secs > 0 else 0.0


class SloWatch:
    """Counts, while a simulation runs, the requests certain to miss `slo`
    (no first token by arrival + TTFT, or finished late), so that a run
    which can no longer reach `target` attainment stops early: a rate
    probe past capacity costs a fraction of a full run."""

    def __init__(self, slo: Slo, target: float, requests: int):
        self.slo = slo
        self.requests = requests
        self.need = math.ceil(target * requests - 1e-9)   # met requests a pass needs
        self.budget = requests - self.need                 # misses a pass can afford
        self.missed: set[str] = set()

    def miss(self, req_id: str) -> None:
        self.missed.add(req_id)

    def check(self, record: Record) -> None:
        """A finished request: count it if it was late."""
        if not self.slo.met(record.to_json()):
            self.missed.add(record.id)

    @property
    def hopeless(self) -> bool:
        return len(self.missed) > self.budget


def format_summary(summary: dict) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4f}"
        return str(v)
    width = max(len(k) for k in summary)
    return "\n".join(f"{k:<{width}}  {fmt(v)}" for k, v in summary.items())


def plot_lines(path, lines: dict, xlabel: str, ylabel: str, title: str,
               reference: tuple | None = None, marked: tuple | None = None) -> bool:
    """Draw one line a series (`lines`: label -> (xs, ys)) into a PNG,
    `reference` (xs, ys, label) dashed and the points `marked` (xs, ys,
    label) as black crosses. False, with a note, when matplotlib is not
    installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    many = len(lines) > 8
    fig, ax = plt.subplots(figsize=(9.5, 4.5) if many else (6, 4))
    if len(lines) > 10:
        ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for label, (xs, ys) in lines.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    if reference is not None:
        ax.plot(reference[0], reference[1], "k--", linewidth=0.8, label=reference[2])
    if marked is not None and marked[0]:
        ax.plot(marked[0], marked[1], "kx", linestyle="none", markersize=6, label=marked[2])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if many:      # beside the axes, not over the lines
        ax.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    else:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
