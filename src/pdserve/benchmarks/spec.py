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
Beside each table, the gate's rounds per batch bucket (spec_gate_log.py).
`--threads 1` on a shared host keeps CPU time a token this process's own.

`--pd`: the same prompts through a P/D pair (roles/local_pair.py, pages
copied in process) against a fused engine at k = 3: P proposes after the
first token, D verifies first; the mean acceptance lengths side by side.
`--draft`: the draft-model proposer's cases (benchmarks/spec_draft.py).
Greedy output tokens of every case are checked against speculation off
(they agree in float32; in bfloat16 a verify row rounds as a prefill chunk
does, so a near tie may resolve differently: counted, not hidden).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from pdserve.benchmarks.args import positive
from pdserve.benchmarks.spec_gate_log import print_table

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the "
    "clockwork that turned the lens, trimmed the wick, and wrote the weather in a leather "
    "book: wind from the west, a grey swell, two fishing boats returning late. In forty "
    "years the light never failed, though the storms of one winter broke every window on "
    "the seaward side.",
    "To repot a fern, water it the day before so the roots hold together. Choose a pot one "
    "size larger with a drainage hole, and fill the bottom with fresh compost mixed with a "
    "little bark. Ease the plant out, loosen the outer roots with your fingers, set it at "
    "the same depth as before, and press the compost around it gently. Keep it out of direct "
    "sun for a week.",
    "The town council met on Tuesday to discuss the new bridge. The engineer reported that "
    "the old stone piers could carry a steel deck if the foundations were strengthened. "
    "Several residents asked whether the footpath would stay open during the works. The "
    "council agreed to keep one lane and the footpath open, and to publish the schedule on "
    "the library notice board.",
    "Bread needs only flour, water, salt and yeast, but time does most of the work. Mix the "
    "dough until it is smooth, then leave it covered in a warm place until it has doubled. "
    "Fold it, shape it into a round, and let it rise again. Bake it in a hot oven until the "
    "crust is dark and the loaf sounds hollow when you tap its base.",
    "The museum's new gallery opens with a collection of old maps. The earliest shows the "
    "coast as a row of named harbours with nothing drawn inland. Later maps add rivers, "
    "roads and the borders of the counties, and the last one in the room, printed a century "
    "ago, marks every railway station and the distance between them in miles.",
    "A good meeting has a short agenda sent out a day ahead. Start on time, give each item "
    "a fixed number of minutes, and write down every decision and who will act on it. End "
    "with a list of those actions, and send the notes to everyone who attended and to "
    "anyone whose work depends on what was decided.",
    "The hikers left the village before sunrise and followed the river upstream. By midday "
    "they had reached the waterfall, where they ate lunch on the flat rocks beside the pool. "
    "In the afternoon the path climbed steeply through pine forest to the ridge, and from "
    "there they could see the lake, the village and the road they had walked that morning.",
    "Our office will close at noon on Friday for the annual maintenance of the building. "
    "Please save your work and shut down your computers before you leave. The heating will "
    "be off over the weekend, so take home any plants that need warmth. The building will "
    "open again at eight on Monday morning as usual.",
]

TASKS = [
    "Rewrite the following passage exactly as it is, word for word:\n\n{p}",
    "Copy out this text without changing anything:\n\n{p}",
    "Repeat the passage below, replacing every full stop with a full stop and nothing "
    "else:\n\n{p}",
    "Here is a passage. Write it out again, unchanged:\n\n{p}",
]


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
                   "figure; benchmarks/spec_draft.py)")
    p.add_argument("--draft-only", action="store_true", help="only the draft-model cases")


@dataclass
class Case:
    name: str
    spec: dict | None

    def engine_config(self, base: dict):
        from pdserve.scheduler.config import EngineConfig

        return EngineConfig.from_dict(base | ({"speculative": self.spec} if self.spec else {}))


@dataclass
class Measure:
    tokens_per_s: float
    ttft: float
    itl: float
    acceptance: float          # mean acceptance length (0: no verify)
    gate: str
    cpu_ms_per_token: float = 0.0   # this process's CPU time (every thread) over tokens
    rounds_per_request: float = 0.0
    outputs: list = field(default_factory=list)
    gate_log: list = field(default_factory=list)    # the gate's rounds (spec_gate_log.py)


def prompts_for(tokenizer, n: int) -> list:
    """`n` prompts: each passage under each task, through the chat template
    (the plain text for a model without one)."""
    from pdserve.text.chat import render_chat

    out: list[list[int]] = []
    i = 0
    while len(out) < n:
        task = TASKS[(i // len(PASSAGES)) % len(TASKS)].format(p=PASSAGES[i % len(PASSAGES)])
        text = task if tokenizer.chat_template is None else render_chat(
            tokenizer.chat_template, [{"role": "user", "content": task}],
            bos_token=getattr(tokenizer, "bos_token", None),
            eos_token=getattr(tokenizer, "eos_token", None))
        out.append(tokenizer.encode(text))
        i += 1
    return out


def build(model, tokenizer, cfg):
    from pdserve.roles.engine import Engine
    from pdserve.roles.torch_executor import TorchExecutor
    from pdserve.scheduler.planner import Planner

    ex = TorchExecutor(model, tokenizer, cfg, detokenize=False)
    return Engine("fused-0", Planner(cfg, groups=ex.groups), ex, forget_finished=True)


def drive(engine, prompts: list, sp, concurrency: int) -> Measure:
    """A closed loop of `concurrency` requests over `prompts`."""
    from pdserve.scheduler.request import Request, SamplingLimits

    ex = engine.executor
    before = (ex.spec.counts.drafts, ex.spec.counts.accepted_tokens) if ex.spec else (0, 0)
    gate = ex.spec.gate if ex.spec else None
    if gate is not None:
        gate.take_log()         # this drive's rounds only
    queue = list(enumerate(prompts))
    live: dict = {}            # id -> (request, submitted, first, last)
    ttft, itl, outputs = [], [], [None] * len(prompts)
    tokens = rounds = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while queue or live:
        while queue and len(live) < concurrency:
            i, p = queue.pop(0)
            r = Request(f"b{i}", p, SamplingLimits(sp.max_tokens))
            ex.register(r.id, sp, fallback_seed=i, prompt=p)
            engine.submit(r)
            live[r.id] = [r, time.perf_counter(), None, None, i]
        out = engine.step()
        rounds += 1
        now = time.perf_counter()
        if out is None:
            raise RuntimeError("the engine built an empty round with work left")
        if out.failed:
            raise RuntimeError(out.error)
        for rid, rec in list(live.items()):
            r = rec[0]
            if r.output and rec[2] is None:
                rec[2] = now
            if r.output:
                rec[3] = now
            if r.finish_reason is not None:
                n = len(r.output)
                tokens += n
                ttft.append(rec[2] - rec[1])
                if n > 1:
                    itl.append((rec[3] - rec[2]) / (n - 1))
                outputs[rec[4]] = list(r.output)
                del live[rid]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    acc = 0.0
    if ex.spec is not None:
        c = ex.spec.counts
        drafts = c.drafts - before[0]
        acc = 1 + (c.accepted_tokens - before[1]) / drafts if drafts else 0.0
    mode = gate.mode.value if gate is not None else ("ungated" if ex.spec else "-")
    return Measure(tokens / wall, statistics.median(ttft), statistics.median(itl) if itl else 0,
                   acc, mode, outputs=outputs, cpu_ms_per_token=1e3 * cpu / tokens,
                   rounds_per_request=rounds / len(prompts),
                   gate_log=gate.take_log() if gate is not None else [])


def run(args) -> int:
    import torch

    from pdserve.kernels.loader import load_model
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
        from pdserve.benchmarks.spec_draft import run_draft

        run_draft(args, model, tok, sp, levels)
    print(f"# load average after: {_load()}")
    return 0


def _base(max_batch: int) -> dict:
    return dict(page_size=16, total_pages=2048, max_scheduled_tokens=512,
                max_batch_size=max(max_batch, 1), max_context_tokens=2048)


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
        engines = {case.name: build(model, tok, case.engine_config(_base(c))) for case in cases}
        for e in engines.values():          # warm: the first round's allocations
            drive(e, prompts[:1], sp, 1)
        got: dict = {case.name: [] for case in cases}
        for _ in range(args.repeats):
            for case in cases:
                got[case.name].append(drive(engines[case.name], prompts, sp, c))
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
            print(f"| {case.name} | {med(tps):.1f} ({min(tps):.1f}-{max(tps):.1f}) | "
                  f"{med(tps) / off:.2f}x | {med(cpu):.0f} ({min(cpu):.0f}-{max(cpu):.0f}) | "
                  f"{cpu_off / med(cpu):.2f}x | {med(m.rounds_per_request for m in ms):.1f} | "
                  f"{1e3 * med(m.ttft for m in ms):.0f} | {1e3 * med(m.itl for m in ms):.1f} | "
                  f"{f'{acc:.2f}' if acc else '-'} | {ms[-1].gate} | "
                  f"{same}/{len(ms) * len(ref)} |", flush=True)
        print_table({name: [r for m in ms for r in m.gate_log] for name, ms in got.items()})


def _pd(args, model, tok, sp) -> None:
    from pdserve.roles.local_pair import LocalPair

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4, "gate": False}
    cfg = Case("k=3", spec).engine_config(_base(4))
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
