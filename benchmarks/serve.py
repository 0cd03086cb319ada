"""`pdserve bench serve`: load a running deployment (or start one per
--config, side by side in one run) through the client library.

Workload: N synthetic prompts, or a replayed trace (Mooncake JSONL or Azure
CSV from shared/data/traces, lengths capped to what the model can take).
Arrivals: as fast as `--concurrency` allows, or Poisson at `--rate` req/s
(seeded). Reports TTFT, TPOT, ITL and E2E percentiles and throughput,
prints a table and saves JSON.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdserve.cluster.sim_report import percentile


@dataclass
class Sample:
    prompt: list
    max_tokens: int
    arrival_s: float = 0.0


@dataclass
class Timing:
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    gaps: list = field(default_factory=list)


def workload(n: int, prompt_len: int, max_tokens: int, trace: str | None, limit: int | None,
             max_prompt: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    if trace is None:
        return [Sample([rng.randrange(95) for _ in range(prompt_len)], max_tokens)
                for _ in range(n)]
    from pdserve.cluster.trace import read_trace

    out = []
    for t in read_trace(trace, limit=limit or n):
        length = min(len(t.prompt), max_prompt)
        out.append(Sample([rng.randrange(95) for _ in range(length)],
                          min(t.max_new_tokens or max_tokens, max_tokens), t.arrival_s))
    return out


def run(address: str, samples: list[Sample], concurrency: int, rate: float | None,
        seed: int, progress: bool = True) -> dict:
    from tqdm import tqdm

    from pdserve.client import Client

    client = Client(address, timeout=600)
    timings = [Timing() for _ in samples]
    bar = tqdm(total=len(samples), disable=not progress, unit="req", desc="bench serve")
    lock = threading.Lock()

    def one(i: int) -> None:
        s, t = samples[i], timings[i]
        t0 = last = time.perf_counter()
        try:
            for chunk in client.generate_stream(s.prompt, max_tokens=s.max_tokens,
                                                ignore_eos=True):
                now = time.perf_counter()
                if chunk.token_ids:
                    if t.ttft is None:
                        t.ttft = now - t0
                    else:
                        t.gaps.append(now - last)
                    last = now
                    t.tokens += len(chunk.token_ids)
            t.e2e = time.perf_counter() - t0
            t.ok = True
        except Exception as e:            # counted, reported
            t.error = str(e)
        with lock:
            bar.update(1)

    rng = random.Random(seed)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        due = 0.0
        for i in range(len(samples)):
            if rate:
                due += rng.expovariate(rate)
                wait = start + due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)          # pacing arrivals, not waiting on a race
            pool.submit(one, i)
    wall = time.perf_counter() - start
    bar.close()
    client.close()
    ok = [t for t in timings if t.ok]
    tpot = [(t.e2e - t.ttft) / (t.tokens - 1) for t in ok if t.tokens > 1]
    gaps = [g for t in ok for g in t.gaps]

    def pct(xs):
        return {"p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9),
                "p99": percentile(xs, 0.99)}
    return {"requests": len(samples), "ok": len(ok), "failed": len(samples) - len(ok),
            "wall_s": wall, "req_per_s": len(ok) / wall,
            "output_tok_per_s": sum(t.tokens for t in ok) / wall,
            "ttft_s": pct([t.ttft for t in ok]), "tpot_s": pct(tpot), "itl_s": pct(gaps),
            "e2e_s": pct([t.e2e for t in ok]),
            "errors": sorted({t.error for t in timings if t.error})[:5]}


def main(address: str | None, configs: list[str], n: int, prompt_len: int, max_tokens: int,
         concurrency: int, rate: float | None, trace: str | None, limit: int | None,
         max_prompt: int, out: str | None, seed: int = 0) -> int:
    samples = workload(n, prompt_len, max_tokens, trace, limit, max_prompt, seed)
    results = []
    if address:
        results.append((address, run(address, samples, concurrency, rate, seed)))
    for path in configs:
        from pdserve.cluster.config import load_config
        from pdserve.cluster.deploy import Deployment

        dep = Deployment(load_config(path))
        try:
            addr = dep.start()
            run(addr, samples[: min(4, len(samples))], concurrency, None, seed, progress=False)
            results.append((path, run(addr, samples, concurrency, rate, seed)))
        finally:
            dep.stop()
    print(f"{len(samples)} requests, concurrency {concurrency}, "
          f"{'rate %.2f req/s' % rate if rate else 'closed loop'}")
    print(f"{'target':<30} {'ok':>4} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'ITL p99':>8} {'E2E p50':>8}")

    def ms(v):
        return f"{v * 1000:.0f}ms" if v is not None else "-"
    for name, r in results:
        print(f"{name[-30:]:<30} {r['ok']:>4} {r['req_per_s']:>6.2f} {r['output_tok_per_s']:>7.1f} "
              f"{ms(r['ttft_s']['p50']):>9} {ms(r['ttft_s']['p99']):>9} "
              f"{ms(r['tpot_s']['p50']):>9} {ms(r['itl_s']['p99']):>8} {ms(r['e2e_s']['p50']):>8}")
        for err in r["errors"]:
            print(f"  error: {err}")
    if out:
        with open(out, "w") as f:
            json.dump({name: r for name, r in results}, f, indent=1)
    return 0 if all(r["failed"] == 0 for _, r in results) else 1
