"""`pdserve bench spec`: speculative decoding (n-gram prompt lookup) against
plain decoding on an input-grounded workload, and P/D against fused.

The workload asks the model to rewrite, copy out or lightly edit a passage
given in the prompt (original passages, a chat template's user turn), the
case where lookup pays: the answer repeats the input. One model (SmolLM2-135M
by default) serves every case in turn, each in an engine of its own
(planner and executor, in process): speculation off, then n-gram at each k
of `--ks`, with the gate on (the default) and, with `--ungated`, off. At each
concurrency of `--concurrency` a closed loop keeps that many requests in
flight (`--requests` per concurrency level, scaled by it) and records when
each request's tokens appear after each round: tokens/s over the case's
wall time, TTFT (submission to first token) and ITL (a request's first to
last token over its tokens after the first), medians over requests, mean
acceptance length (tokens a verify gives), and the gate's state at the end.
Cases run interleaved, `--repeats` times, so a busy host slows every case
alike; the table gives each figure's median over repeats and the tokens/s
spread (min-max) beside it, and the host's load average. Beside wall-clock
tokens/s: this process's CPU time a token (every thread's; less sensitive to
other processes on a shared host than wall time, as `bench disk` does) and
rounds a request (forwards: what acceptance saves, independent of the host).
Beside each table, the gate's rounds per batch bucket (gate_log.py).
`--threads 1` on a shared host keeps CPU time a token this process's own.

`--pd`: the same prompts through a P/D pair (engine/local_pair.py, pages
copied in process) against a fused engine at k = 3: P proposes after the
first token, D verifies first; the mean acceptance lengths side by side.
`--draft`: the draft-model proposer's cases (draft.py).
Greedy output tokens of every case are checked against speculation off
(they agree in float32; in bfloat16 a verify row rounds as a prefill chunk
does, so a near tie may resolve differently: counted, not hidden).
"""

from __future__ import annotations

import os
import statistics

from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.tables import median_range
from pdserve.benchmarks.spec.gate_log import print_table
from pdserve.benchmarks.spec.workload import (Case, base_config, build, drive, prompts_for,
                                              run_cases)


def add_arguments(p) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="model preset (smollm2-135m)")
    p.add_argument("--dtype", default="auto", help="model dtype (auto: bfloat16 on a CPU "
                   "with bfloat16 instructions)")
    p.add_argument("--ks", default="2,3,4,5", help="num_speculative_tokens to compare (2,3,4,5)")
    p.add_argument("--concurrency", default="1,4,16", help="requests in flight (1,4,16)")
    p.add_argument("--requests", type=positive, default=2,
                   help="requests per concurrency level, times the level (2)")
    p.add_argument("--max-tokens", type=positive, default=64, help="new tokens a request (64)")
    p.add_argument("--repeats", type=positive, default=2)
    p.add_argument("--ungated", action="store_true",
                   help="also each k with the gate off (speculation whatever it costs)")
    p.add_argument("--pd", action="store_true",
                   help="also P/D against fused at k=3: mean acceptance length")
    p.add_argument("--pd-only", action="store_true", help="only the P/D comparison")
    p.add_argument("--threads", type=positive, default=None,
                   help="torch threads (default: torch's); 1 on a shared host makes CPU time "
                   "a token this process's own work (a second thread's waits on a "
                   "descheduled first count as CPU time)")
    p.add_argument("--draft", action="store_true",
                   help="also the draft-model proposer: the target drafting for itself and a "
                   "random draft sharing its vocabulary, at k=3 (acceptance as a correctness "
                   "figure; benchmarks/spec/draft.py)")
    p.add_argument("--draft-only", action="store_true", help="only the draft-model cases")


def run(args) -> int:
    import torch

    from pdserve.kernels.models.loader import load_model
    from pdserve.text.sampling_params import SamplingParams

    ks = [int(k) for k in args.ks.split(",") if k]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(None, args.preset, dtype=args.dtype, device="cpu",
                            quantization="none")   # dense, as docs/benchmarks.md's tables ran
    print(f"# pdserve bench spec: {args.preset} ({str(model.dtype).removeprefix('torch.')}) on "
          f"CPU, {torch.get_num_threads()} threads; {args.max_tokens} new tokens a request, "
          f"greedy; load average before: {_load()}")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=False)
    if not (args.pd_only or args.draft_only):
        _sweep(args, model, tok, ks, levels, sp)
    if args.pd or args.pd_only:
        _pd(args, model, tok, sp)
    if args.draft or args.draft_only:
        from pdserve.benchmarks.spec.draft import run_draft

        run_draft(args, model, tok, sp, levels)
    print(f"# load average after: {_load()}")
    return 0


def _sweep(args, model, tok, ks, levels, sp) -> None:
    cases = [Case("off", None)]
    for k in ks:
        cases.append(Case(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                           "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
        if args.ungated:
            cases.append(Case(f"ngram k={k} ungated", {
                "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4, "gate": False}))
    for c in levels:
        prompts = prompts_for(tok, args.requests * c)
        _, got = run_cases(model, tok, cases, prompts, sp, c, args.repeats)
        off = statistics.median(m.tokens_per_s for m in got["off"])
        ref = got["off"][0].outputs
        print(f"\n## concurrency {c}: {len(prompts)} requests, {args.repeats} repeats "
              f"(load average {_load()})\n")
        print("| case | tokens/s (min-max) | vs off | CPU ms/token (min-max) | vs off | "
              "rounds/request | TTFT ms | ITL ms | mean acceptance length | gate at end | "
              "outputs as off |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        med = statistics.median
        cpu_off = med(m.cpu_ms_per_token for m in got["off"])
        for case in cases:
            ms = got[case.name]
            tps = [m.tokens_per_s for m in ms]
            cpu = [m.cpu_ms_per_token for m in ms]
            same = sum(o == r for m in ms for o, r in zip(m.outputs, ref))
            acc = med(m.acceptance for m in ms)
            print(f"| {case.name} | {median_range(tps)} | "
                  f"{med(tps) / off:.2f}x | {median_range(cpu, '.0f')} | "
                  f"{cpu_off / med(cpu):.2f}x | {med(m.rounds_per_request for m in ms):.1f} | "
                  f"{1e3 * med(m.ttft for m in ms):.0f} | {1e3 * med(m.itl for m in ms):.1f} | "
                  f"{f'{acc:.2f}' if acc else '-'} | {ms[-1].gate} | "
                  f"{same}/{len(ms) * len(ref)} |", flush=True)
        print_table({name: [r for m in ms for r in m.gate_log] for name, ms in got.items()})


def _pd(args, model, tok, sp) -> None:
    from pdserve.engine.local_pair import LocalPair

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4, "gate": False}
    cfg = Case("k=3", spec).engine_config(base_config(4))
    prompts = prompts_for(tok, 8)
    fused = build(model, tok, cfg)
    f = drive(fused, prompts, sp, 4)
    pair = LocalPair(model, tok, cfg)
    outs = pair.generate(prompts, sp)
    assert pair.dx.spec is not None and fused.executor.spec is not None
    c = pair.dx.spec.counts
    pd_acc = c.mean_acceptance_length
    same = sum(a == b for a, b in zip(outs, f.outputs))
    print(f"\n## P/D against fused, k=3 (ungated), {len(prompts)} requests\n")
    print("| engine | mean acceptance length | verifies | candidates P shipped | "
          "outputs as fused |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| fused | {f.acceptance:.2f} | {fused.executor.spec.counts.drafts} | - | - |")
    print(f"| P/D | {pd_acc:.2f} ({pd_acc / f.acceptance - 1:+.1%}) | {c.drafts} | "
          f"{pair.shipped_drafts} | {same}/{len(prompts)} |", flush=True)


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"
