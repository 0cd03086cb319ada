"""Plan-build cost per decode round, against a minimal decode-only scheduler.

Every request is decoding; each round builds the plan and feeds one token
back per request (one batched `apply`). The planner's safe_steps is small so
decodes cross page boundaries and exercise decode admission at the natural
rate (one round in page_size). The baseline is the least a scheduler can do:
append a token, take a page off a free list at each boundary.
"""

from __future__ import annotations

import argparse
import time

from pdserve.benchmarks.common.options import positive
from pdserve.scheduler import EngineConfig, Planner, Request, SamplingLimits, StepResult

PAGE = 16
PROMPT = 32
SAFE_STEPS = 64


class MinimalScheduler:
    """No chunking, no prefix cache, no retraction: the floor to compare to."""

    def __init__(self, n: int, total_pages: int):
        self.free = list(range(total_pages))
        self.reqs = []
        for i in range(n):
            blocks = [self.free.pop() for _ in range(PROMPT // PAGE + 1)]
            self.reqs.append([list(range(PROMPT + 1)), blocks])

    def build(self):
        batch = []
        free = self.free
        for r in self.reqs:
            if len(r[0]) > len(r[1]) * PAGE:
                r[1].append(free.pop())
            batch.append(r)
        return batch

    def apply(self, batch, tokens):
        for r, t in zip(batch, tokens):
            r[0].append(t)


def _planner(n: int, rounds: int) -> Planner:
    pages = n * (PROMPT + 2 * SAFE_STEPS + rounds + 4 * PAGE) // PAGE + 64
    cfg = EngineConfig(page_size=PAGE, total_pages=pages, max_scheduled_tokens=max(2048, n * PROMPT),
                       max_batch_size=n, safe_steps=SAFE_STEPS)
    p = Planner(cfg)
    for i in range(n):
        p.submit(Request(f"req-{i}", [i % 1000 + 1] + list(range(PROMPT - 1)),
                         SamplingLimits(max_new_tokens=rounds + 2 * SAFE_STEPS)))
    while len(p.running) < n or any(type(r.state).__name__ != "Decoding" for r in p.running.values()):
        plan = p.build()
        p.apply(plan, StepResult([1] * len(plan.decodes),
                                 [1 if op.completes else None for op in plan.prefills]))
    return p


def measure(n: int, rounds: int) -> dict:
    p = _planner(n, rounds)
    build = apply = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        plan = p.build()
        t1 = time.perf_counter()
        toks = [1] * len(plan.decodes)
        t2 = time.perf_counter()
        p.apply(plan, StepResult(toks, []))
        t3 = time.perf_counter()
        assert len(plan.decodes) == n
        build += t1 - t0
        apply += t3 - t2
    p.check_invariants()
    m = MinimalScheduler(n, p.cfg.total_pages)
    base = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        batch = m.build()
        t1 = time.perf_counter()
        toks = [1] * len(batch)
        t2 = time.perf_counter()
        m.apply(batch, toks)
        t3 = time.perf_counter()
        base += (t1 - t0) + (t3 - t2)
    per = 1e6 / (rounds * n)
    return {"n": n, "build_us_round": build * 1e6 / rounds, "round_us": (build + apply) * 1e6 / rounds,
            "us_per_req": (build + apply) * per, "build_us_per_req": build * per,
            "apply_us_per_req": apply * per, "baseline_us_per_req": base * per}


def main(sizes=(64, 256, 1024, 4096), rounds: int = 200) -> int:
    rows = [measure(n, rounds) for n in sizes]
    print(f"planner decode round, page_size={PAGE}, {rounds} rounds each "
          f"(build + one batched apply), baseline = minimal decode-only scheduler")
    print(f"{'decoding':>9} {'round µs':>10} {'µs/req':>8} {'build':>7} {'apply':>7} "
          f"{'baseline µs/req':>16} {'vs base':>8}")
    for r in rows:
        print(f"{r['n']:>9} {r['round_us']:>10.0f} {r['us_per_req']:>8.2f} "
              f"{r['build_us_per_req']:>7.2f} {r['apply_us_per_req']:>7.2f} "
              f"{r['baseline_us_per_req']:>16.2f} {r['us_per_req'] / r['baseline_us_per_req']:>7.1f}x")
    by_n = {r["n"]: r for r in rows}
    if 1024 in by_n and 4096 in by_n:
        ratio = by_n[4096]["us_per_req"] * 4096 / (by_n[1024]["us_per_req"] * 1024)
        print(f"growth 1024 -> 4096 decoding: round time x{ratio:.2f} (linear = x4.00)")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=positive, nargs="+", default=[64, 256, 1024, 4096],
                   help="decoding requests per round (64 256 1024 4096)")
    p.add_argument("--rounds", type=positive, default=200, help="rounds timed per size (200)")


def run(args) -> int:
    return main(sizes=args.sizes, rounds=args.rounds)
