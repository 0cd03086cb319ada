"""`pdserve bench loop`: where an engine's round goes, and what overlapping
the planner with the forward could save.

A fused engine (`pdserve.LLM`'s planner and executor, no server) runs B
requests of `--prompt-len` tokens to `--max-tokens` each, and every round
is split into: the planner's `build`, the executor's input staging and
forward, its sampling and per-token bookkeeping, and the planner's `apply`.
Overlap (building round N+1's plan while round N's forward runs) can hide
at most build + apply: the table prints that share and the round rate it
would give if it were hidden completely. On a GPU the forward is queued
asynchronously and the host work is what overlap hides; on a CPU the forward
and the planner compete for the same cores, so the bound is an upper one.

`--overlap` measures it instead: the same workload through `Engine` with
`engine.overlap` off and on (round N+1 built while N's forward runs on the
executor's forward thread), side by side: tokens/s over the decode-only
rounds and the share of such a round the plan build takes.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.timing import MethodClock


def _fused(model: str, batch: int, prompt_len: int, max_tokens: int, threads: int,
           spare_pages: int, **engine) -> tuple:
    """`model` in a fused planner and executor (pages for every request's
    prompt and output, `spare_pages` more each), and `batch` random prompts
    registered with the executor: (executor, planner, requests to submit)."""
    import torch

    from pdserve.kernels.models.loader import load_model
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.engine.executor.torch_executor import TorchExecutor
    from pdserve.scheduler.config import EngineConfig
    from pdserve.scheduler.round.grammar import Role
    from pdserve.scheduler.planner import Planner
    from pdserve.scheduler.request import Request, SamplingLimits

    torch.set_num_threads(threads)
    m, tok = load_model(None, model, quantization="none")   # dense, as docs/benchmarks.md's tables ran
    pages = batch * (-(-(prompt_len + max_tokens) // 16) + spare_pages) + 16
    cfg = EngineConfig(page_size=16, total_pages=pages, max_batch_size=batch,
                       max_scheduled_tokens=max(512, prompt_len), **engine)
    ex = TorchExecutor(m, tok, cfg, detokenize=False)
    planner = Planner(cfg, Role.FUSED, groups=ex.groups)
    g = torch.Generator().manual_seed(0)
    requests = []
    for i in range(batch):
        ids = torch.randint(3, m.cfg.vocab_size, (prompt_len,), generator=g).tolist()
        ex.register(f"r{i}", SamplingParams(max_tokens=max_tokens, ignore_eos=True), i)
        requests.append(Request(f"r{i}", ids, SamplingLimits(max_new_tokens=max_tokens)))
    return ex, planner, requests


def _run(model: str, batch: int, prompt_len: int, max_tokens: int, threads: int) -> dict:
    ex, planner, requests = _fused(model, batch, prompt_len, max_tokens, threads, spare_pages=1)
    forward = MethodClock(ex, "forward")
    for r in requests:
        planner.submit(r)
    rounds = []
    while planner.has_work():
        forward.reset()
        t0 = time.perf_counter()
        plan = planner.build()
        t1 = time.perf_counter()
        result = ex.run(plan)
        t2 = time.perf_counter()
        planner.apply(plan, result)
        t3 = time.perf_counter()
        if plan.decodes and not plan.prefills:          # the steady decode rounds
            rounds.append((t1 - t0, forward.seconds, t2 - t1 - forward.seconds, t3 - t2,
                           t3 - t0, len(plan.decodes)))
    planner.check_invariants()
    med = [statistics.median(r[k] for r in rounds) for k in range(5)]
    return {"rounds": len(rounds), "build": med[0], "forward": med[1], "sample": med[2],
            "apply": med[3], "round": med[4],
            "tokens_per_s": sum(r[5] for r in rounds) / sum(r[4] for r in rounds)}


def _run_engine(model: str, batch: int, prompt_len: int, max_tokens: int, threads: int,
                overlap: bool) -> dict:
    """The workload of `_run` through `Engine.step`, overlap off or on."""
    from pdserve.engine.engine import Engine

    ex, planner, requests = _fused(model, batch, prompt_len, max_tokens, threads, spare_pages=2,
                                   overlap=overlap)
    engine = Engine("bench", planner, ex)
    build = MethodClock(planner, "build")
    for r in requests:
        engine.submit(r)
    rounds = []
    while engine.has_work():
        build.reset()
        t0 = time.perf_counter()
        out = engine.step()
        dt = time.perf_counter() - t0
        if out is not None and out.plan.decodes and not out.plan.prefills \
                and len(out.plan.decodes) == batch:          # the steady decode rounds
            rounds.append((build.seconds, dt, len(out.plan.decodes)))
    ex.close()
    planner.assert_idle()
    return {"rounds": len(rounds),
            "build_share": statistics.median(b for b, _, _ in rounds)
            / statistics.median(r for _, r, _ in rounds),
            "round": statistics.median(r for _, r, _ in rounds),
            "tokens_per_s": sum(n for _, _, n in rounds) / sum(r for _, r, _ in rounds)}


def compare(model: str, batches, prompt_len: int, max_tokens: int, threads: int) -> int:
    """Overlap off and on, side by side (`--overlap`)."""
    print(f"{model}, fused, {threads} torch thread(s), prompt {prompt_len}, {max_tokens} tokens "
          f"each; decode-only rounds through Engine.step")
    print("| batch | round off | round on | tok/s off | tok/s on | on / off | "
          "build share off | build share on |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        off = _run_engine(model, b, prompt_len, max_tokens, threads, False)
        on = _run_engine(model, b, prompt_len, max_tokens, threads, True)
        print(f"| {b} | {off['round'] * 1e3:.2f} ms | {on['round'] * 1e3:.2f} ms | "
              f"{off['tokens_per_s']:,.0f} | {on['tokens_per_s']:,.0f} | "
              f"{on['tokens_per_s'] / off['tokens_per_s']:.3f} | {off['build_share']:.1%} | "
              f"{on['build_share']:.1%} |", flush=True)
    return 0


def main(model: str = "tiny", batches=(16, 64, 256), prompt_len: int = 8,
         max_tokens: int = 256, threads: int = 1) -> int:
    if max_tokens < 2:              # the first token comes from the prefill's round
        raise ValueError(f"--max-tokens {max_tokens} leaves no round that only decodes; "
                         "ask for 2 or more")
    print(f"{model}, fused, {threads} torch thread(s), prompt {prompt_len}, {max_tokens} tokens "
          f"each; medians over the decode-only rounds")
    print("| batch | round | build | forward | sample + tokens | apply | planner share | "
          "tok/s | tok/s with build + apply hidden |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        r = _run(model, b, prompt_len, max_tokens, threads)
        planner = r["build"] + r["apply"]
        share = planner / r["round"]
        print(f"| {b} | {r['round'] * 1e3:.2f} ms | {r['build'] * 1e6:.0f} µs | "
              f"{r['forward'] * 1e3:.2f} ms | {r['sample'] * 1e6:.0f} µs | "
              f"{r['apply'] * 1e6:.0f} µs | {share:.1%} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s'] / (1 - share):,.0f} |", flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["tiny", "smollm2-135m"], default="tiny",
                   help="the preset the engine runs (tiny)")
    p.add_argument("--batches", type=positive, nargs="+", default=[16, 64, 256],
                   help="requests decoding together, one table row each (16 64 256)")
    p.add_argument("--prompt-len", type=positive, default=8, help="tokens of each prompt (8)")
    p.add_argument("--max-tokens", type=positive, default=256,
                   help="new tokens per request (256)")
    p.add_argument("--threads", type=positive, default=1, help="torch intra-op threads (1)")
    p.add_argument("--overlap", action="store_true",
                   help="run engine.overlap off and on side by side instead of the breakdown")


def run(args) -> int:
    if args.overlap:
        if args.max_tokens < 2:
            raise ValueError(f"--max-tokens {args.max_tokens} leaves no round that only "
                             "decodes; ask for 2 or more")
        return compare(args.model, args.batches, args.prompt_len, args.max_tokens, args.threads)
    return main(args.model, args.batches, args.prompt_len, args.max_tokens, args.threads)


if __name__ == "__main__":
    raise SystemExit(main())
