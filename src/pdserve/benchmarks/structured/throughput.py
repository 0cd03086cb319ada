"""`pdserve bench structured`: what structured outputs cost a deployment.

A closed loop of `--concurrency` requests (16) on one in-process engine
(fused) or an in-process P and D pair (engine/local_pair.py), the same
prompts each time, with 0%, 50% and 100% of the requests constrained to a
JSON schema from benchmarks/structured/schemas.json (realistic agent and
extraction schemas; a request asks, through the chat template, for a JSON
object of its schema). Per case: output tokens/s, the mask's CPU time per
constrained token (the mask thread, beside the forward), compile time
p50/p99, and how many constrained outputs were complete and valid against
their schema (jsonschema where installed, else a JSON parse). The cases of
a run alternate, so a busy host slows them alike; the ratio to 0% is the
figure to read (issue 55's goal: 100% structured at >= 0.85x).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from importlib import resources

from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.tables import nearest_rank


def add_arguments(p) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="model preset (smollm2-135m)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=positive, default=16, help="requests in flight (16)")
    p.add_argument("--requests", type=positive, default=32, help="requests per case (32)")
    p.add_argument("--max-tokens", type=positive, default=96, help="new tokens a request (96)")
    p.add_argument("--fractions", default="0,50,100", help="percent structured (0,50,100)")
    p.add_argument("--modes", default="fused,pd", help="fused, pd (1P+1D in-process)")
    p.add_argument("--repeats", type=positive, default=1)


@dataclass
class Measure:
    tokens_per_s: float
    tokens: int
    mask_us_per_token: float
    compile_s: list = field(default_factory=list)
    structured: int = 0
    valid: int = 0


def schemas() -> list[dict]:
    text = (resources.files("pdserve.benchmarks.structured") / "schemas.json").read_text()
    return json.loads(text)


def prompts_for(tokenizer, entries: list[dict], n: int) -> list[list[int]]:
    from pdserve.text.chat import render_chat

    out = []
    for i in range(n):
        e = entries[i % len(entries)]
        ask = (f"Write one realistic example of a {e['name'].replace('_', ' ')} as a JSON "
               f"object matching this schema:\n{json.dumps(e['schema'])}")
        text = ask if tokenizer.chat_template is None else render_chat(
            tokenizer.chat_template, [{"role": "user", "content": ask}],
            bos_token=getattr(tokenizer, "bos_token", None),
            eos_token=getattr(tokenizer, "eos_token", None))
        out.append(tokenizer.encode(text))
    return out


def _params(n: int, percent: int, entries: list[dict], max_tokens: int) -> list:
    from pdserve.text.constraint import Constraint
    from pdserve.text.sampling_params import SamplingParams

    out = []
    for i in range(n):
        # spread evenly: request i is constrained when the running share falls short
        on = (i + 1) * percent // 100 > i * percent // 100
        c = Constraint.json_schema(entries[i % len(entries)]["schema"]) if on else None
        out.append(SamplingParams(max_tokens=max_tokens, temperature=0, constraint=c))
    return out


def _valid(text: str, schema: dict) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        return True
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError:
        return False
    return True


class _Fused:
    def __init__(self, model, tok, cfg):
        from pdserve.engine.engine import Engine
        from pdserve.engine.executor.torch_executor import TorchExecutor
        from pdserve.scheduler.planner import Planner

        self.ex = TorchExecutor(model, tok, cfg, detokenize=False)
        self.engine = Engine("fused-0", Planner(cfg, groups=self.ex.groups), self.ex)
        self.seq = 0

    def submit(self, prompt, sp):
        from pdserve.scheduler.request import Request, SamplingLimits

        self.seq += 1
        r = Request(f"s{self.seq}", prompt, SamplingLimits(sp.max_tokens))
        self.ex.register(r.id, sp, fallback_seed=self.seq, prompt=prompt)
        self.engine.submit(r)
        return r

    def tick(self):
        out = self.engine.step()
        if out is None and self.ex.grammars.waiting():
            self.ex.grammars.wait_any(0.01)
        elif out is not None and out.failed:
            raise RuntimeError(out.error)

    def grammars(self):
        return [self.ex.grammars]


class _Pair:
    def __init__(self, model, tok, cfg):
        from pdserve.engine.local_pair import LocalPair

        self.pair = LocalPair(model, tok, cfg)

    def submit(self, prompt, sp):
        return self.pair.submit(prompt, sp)

    def tick(self):
        self.pair.tick()

    def grammars(self):
        return [self.pair.px.grammars, self.pair.dx.grammars]


def drive(runner, prompts, params, entries, concurrency: int) -> tuple[Measure, dict]:
    """A closed loop over `prompts`, `concurrency` in flight."""
    counts = [g.counts for g in runner.grammars()]
    mask0 = sum(c.mask_cpu_s for c in counts)
    masks0 = sum(c.masks for c in counts)
    comp0 = [len(c.compile_s) for c in counts]
    queue = list(range(len(prompts)))
    live: dict = {}
    done: dict = {}
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            i = queue.pop(0)
            live[i] = runner.submit(prompts[i], params[i])
        runner.tick()
        for i, r in list(live.items()):
            if r.finish_reason is not None:
                done[i] = r
                del live[i]
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output) for r in done.values())
    masks = sum(c.masks for c in counts) - masks0
    mask_s = sum(c.mask_cpu_s for c in counts) - mask0
    compile_s = [s for c, k in zip(counts, comp0) for s in c.compile_s[k:]]
    m = Measure(tokens / wall, tokens, 1e6 * mask_s / masks if masks else 0.0, compile_s)
    return m, done


def run(args) -> int:
    return main(args.preset, args.dtype, args.concurrency, args.requests, args.max_tokens,
                [int(f) for f in args.fractions.split(",") if f],
                [m for m in args.modes.split(",") if m], args.repeats)


def main(preset: str = "smollm2-135m", dtype: str = "auto", concurrency: int = 16,
         requests: int = 32, max_tokens: int = 96, fractions=(0, 50, 100),
         modes=("fused", "pd"), repeats: int = 1) -> int:
    import torch

    from pdserve.kernels.models.loader import load_model
    from pdserve.scheduler.config import EngineConfig

    entries = schemas()
    model, tok = load_model(None, preset, dtype=dtype, device="cpu")
    cfg = EngineConfig(page_size=16, total_pages=2048, max_scheduled_tokens=512,
                       max_batch_size=max(concurrency, 1), max_context_tokens=2048)
    prompts = prompts_for(tok, entries, requests)
    print(f"# pdserve bench structured: {preset} on CPU, {torch.get_num_threads()} "
          f"threads; {requests} requests a case at concurrency {concurrency}, "
          f"{max_tokens} new tokens at most, greedy; {len(entries)} schemas")
    runners = {m: (_Fused if m == "fused" else _Pair)(model, tok, cfg) for m in modes}
    warm = _params(1, 100, entries, 8)
    for r in runners.values():                      # the grammar vocabulary, first rounds
        drive(r, prompts[:1], warm, entries, 1)
    got: dict = {}
    for _ in range(repeats):
        for mode in modes:
            for f in fractions:
                params = _params(requests, f, entries, max_tokens)
                m, done = drive(runners[mode], prompts, params, entries, concurrency)
                for i, r in done.items():
                    if params[i].constraint is None:
                        continue
                    m.structured += 1
                    text = tok.decode(r.output)
                    m.valid += r.finish_reason == "stop" and _valid(
                        text, entries[i % len(entries)]["schema"])
                got.setdefault((mode, f), []).append(m)
    print("| mode | structured | output tok/s | vs 0% | mask CPU µs/token | compile p50 | "
          "compile p99 | complete and valid |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode in modes:
        base = _median([m.tokens_per_s for m in got.get((mode, 0), [])])
        for f in fractions:
            ms = got[(mode, f)]
            tps = _median([m.tokens_per_s for m in ms])
            comp = [s for m in ms for s in m.compile_s]
            structured = sum(m.structured for m in ms)
            valid = sum(m.valid for m in ms)
            print(f"| {mode} | {f}% | {tps:.1f} | "
                  f"{tps / base:.2f}x | " if base else f"| {mode} | {f}% | {tps:.1f} | - | ",
                  end="")
            print(f"{_median([m.mask_us_per_token for m in ms]):.0f} | "
                  f"{_ms(comp, 0.5)} | {_ms(comp, 0.99)} | "
                  + (f"{valid}/{structured}" if structured else "-") + " |")
    return 0


def _median(xs):
    import statistics

    return statistics.median(xs) if xs else 0.0


def _ms(xs, q) -> str:
    return f"{nearest_rank(xs, q) * 1e3:.1f} ms" if xs else "-"
