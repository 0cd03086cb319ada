"""What `pdserve bench spec` and its `--draft` cases (ngram.py,
draft.py) share: the input-grounded workload (a passage to copy out or
lightly edit, through the chat template), a case's engine config, and a
closed loop that drives one in-process engine and measures it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

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
    gate_log: list = field(default_factory=list)    # the gate's rounds (gate_log.py)


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
    from pdserve.engine.engine import Engine
    from pdserve.engine.executor.torch_executor import TorchExecutor
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


def run_cases(model, tokenizer, cases: list[Case], prompts: list, sp, concurrency: int,
              repeats: int) -> tuple[dict, dict]:
    """Each case in an engine of its own, warmed on one prompt, then every
    case driven over `prompts` in turn, `repeats` times (a busy host slows
    them alike): (case name -> engine, case name -> its Measures)."""
    engines = {case.name: build(model, tokenizer, case.engine_config(base_config(concurrency)))
               for case in cases}
    for e in engines.values():          # warm: the first round's allocations
        drive(e, prompts[:1], sp, 1)
    got: dict[str, list[Measure]] = {case.name: [] for case in cases}
    for _ in range(repeats):
        for case in cases:
            got[case.name].append(drive(engines[case.name], prompts, sp, concurrency))
    return engines, got


def base_config(max_batch: int) -> dict:
    """The engine config every case starts from, batching up to `max_batch`."""
    return dict(page_size=16, total_pages=2048, max_scheduled_tokens=512,
                max_batch_size=max(max_batch, 1), max_context_tokens=2048)
