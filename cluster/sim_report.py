"""What `pdserve sim` reports: per-request records, the summary, goodput."""

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
                tpot = (self.finish_s - self.first_token_s) / (self.output_tokens - 1)
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
    summary = {s: sum(1 for r in rows if r["status"] == s)
               for s in ("finished", "rejected", "failed", "unfinished")}
    summary.update({
        "virtual_seconds": virtual_seconds,
        "output_tok_per_s": out_tokens / virtual_seconds if virtual_seconds > 0 else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
    })
    return summary


def goodput(result: dict, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Finished requests a second that met both SLOs (DistServe's goodput)."""
    ok = sum(1 for r in result["requests"] if r["status"] == "finished"
             and r["ttft_s"] <= ttft_slo_s and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo_s))
    secs = result["summary"]["virtual_seconds"]
    return ok / secs if secs > 0 else 0.0


def format_summary(summary: dict) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4f}"
        return str(v)
    width = max(len(k) for k in summary)
    return "\n".join(f"{k:<{width}}  {fmt(v)}" for k, v in summary.items())
