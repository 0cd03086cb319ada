"""The autoscaler under a load that rises and falls (a sine, as in Dynamo's
failing scenario, scaled down to this machine), against the same run on a
fixed 1P+1D: SLO attainment (both TTFT and TPOT met), failures, and the
engines serving over time.

    pdserve bench autoscale [--seconds 120]

The number of clients follows one period of a sine between 1 and `peak`;
each client sends requests back to back. On a 2-core CPU machine a new
engine brings KV pages, not compute (every engine shares the same two
cores), so the shape to expect is fewer requests waiting for pages, not
faster tokens.
"""

from __future__ import annotations

import argparse
import math
import threading
import time

from pdserve.benchmarks.common.tables import nearest_rank

ENGINE = {"page_size": 16, "total_pages": 32, "max_scheduled_tokens": 256,
          "max_batch_size": 16}
AUTOSCALE = {"prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2},
             "ttft_s": 0.5, "itl_s": 5.0, "interval_s": 1.0, "cooldown_s": 3.0,
             "scale_down_after_s": 6.0, "drain_deadline_s": 60.0, "queue_high": 3}
SLO_TTFT, SLO_TPOT = 2.0, 0.25       # seconds: what a request must meet to count
NEW = 80


def trial(autoscale: bool, seconds: float, peak: int) -> dict:
    """One deployment, autoscaled or fixed 1P+1D, under one period of the load."""
    from pdserve.client import Client
    from pdserve.config import ServeConfig
    from pdserve.cluster.deploy import Deployment

    cfg = {"engine": ENGINE, "cluster": {"prefill": 1, "decode": 1}}
    if autoscale:
        cfg["autoscale"] = AUTOSCALE  # type: ignore[assignment]
    dep = Deployment(ServeConfig.from_dict(cfg), num_cpus=2,
                     engine_options={"transfer_timeout_s": 30.0})
    dep.start()
    c = Client(dep.address, timeout=300)
    records, failures, shape = [], [], []
    t0 = time.monotonic()
    end = t0 + seconds

    def wanted(now: float) -> int:
        return 1 + round((peak - 1) * math.sin(math.pi * (now - t0) / seconds))

    def client(i: int) -> None:
        while time.monotonic() < end:
            if i >= wanted(time.monotonic()):
                time.sleep(0.2)              # this client is off in this part of the wave
                continue
            start, first = time.monotonic(), None
            try:
                n = 0
                for chunk in c.generate_stream("load " * (10 + i % 7), max_tokens=NEW,
                                               ignore_eos=True):
                    if first is None and chunk.token_ids:
                        first = time.monotonic()
                    n += len(chunk.token_ids)
                done = time.monotonic()
                tpot = (done - first) / max(n - 1, 1)  # type: ignore[operator]
                records.append((first - start, tpot, n))  # type: ignore[operator]
            except Exception as e:           # a lost request: counted
                failures.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(peak)]
    for t in threads:
        t.start()
    while time.monotonic() < end:
        info = c.server_info()["engines"]
        shape.append(sum(1 for e in info if not e.get("draining")))
        time.sleep(2.0)
    for t in threads:
        t.join(300)
    history = dep.autoscale_history()
    c.close()
    dep.stop()
    ok = [r for r in records if r[0] <= SLO_TTFT and r[1] <= SLO_TPOT]
    ttfts = [r[0] for r in records]
    return {"requests": len(records), "failures": len(failures),
            "attainment": len(ok) / max(len(records), 1),
            "ttft_p50": nearest_rank(ttfts, 0.5) if ttfts else float("nan"),
            "ttft_p90": nearest_rank(ttfts, 0.9) if ttfts else float("nan"),
            "tokens": sum(r[2] for r in records), "most_engines": max(shape, default=0),
            "last_engines": shape[-1] if shape else 0,
            "steps": [(e["kind"], e["role"]) for e in history if e["kind"] in ("add", "drain")]}


def main(seconds: float = 120.0, peak: int = 8) -> int:
    print(f"sine load, 1 to {peak} clients over {seconds:.0f} s, {NEW} tokens a request; "
          f"SLO: TTFT <= {SLO_TTFT} s and TPOT <= {SLO_TPOT * 1000:.0f} ms")
    rows = [("fixed 1P+1D", trial(False, seconds, peak)),
            ("autoscaled 1-2P, 1-2D", trial(True, seconds, peak))]
    print(f"{'deployment':<24} {'requests':>8} {'failed':>6} {'SLO met':>8} "
          f"{'TTFT p50':>9} {'TTFT p90':>9} {'tokens':>7} {'engines max/end':>16}  steps")
    for name, r in rows:
        print(f"{name:<24} {r['requests']:>8} {r['failures']:>6} {r['attainment']:>8.0%} "
              f"{r['ttft_p50']:>8.2f}s {r['ttft_p90']:>8.2f}s {r['tokens']:>7} "
              f"{r['most_engines']:>8}/{r['last_engines']:<7}  {r['steps']}")
    return 0 if all(r["failures"] == 0 for _, r in rows) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0,
                   help="one period of the sine, for each deployment (60)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="clients at the peak of the sine (16)")


def run(args) -> int:
    return main(args.seconds, args.concurrency)
