"""Sliding-window cache groups against keeping every layer's history.

Gemma 3 27B (52 sliding layers of window 1024, 10 full) on one H100's KV
pool: what a request holds per group, how many requests the pool holds at
once, that figure checked by running the planner, and a Mooncake slice
simulated both ways. The "every layer full" side is the same model with the
hybrid allocator off: one pool keeps all 62 layers' history, attention still
reads only the window, so only memory differs between the two.

Accounting (pages of `PAGE` tokens; a page of a group costs its layers'
bytes). A resident request holds, in the full-history group, its prompt and
decode slot (capacity.single_request_pages), and in a sliding group its
window and decode slot (capacity.sliding_request_pages with a 1-token
chunk). The one prefill in flight holds a chunk more: a sliding pool of N
requests is (N - 1) x that + sliding_request_pages(W, chunk), what the
planner needs to ramp up to N one prompt at a time. The split between the
pools that maximizes N gives the sliding pool exactly that and the full
pool every byte left.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.cache.bounds import OVERHEAD, kv_pool_bytes
from pdserve.benchmarks.common.tables import gb, s_or_ms
from pdserve.benchmarks.common.traces import MOONCAKE_CONV, trace_file
from pdserve.config import ClusterShape, ServeConfig, SimulateConfig
from pdserve.sim.simulation import Simulation
from pdserve.sim.report import percentile
from pdserve.sim.trace import read_trace
from pdserve.sim.cost.roofline import GPUS, MODELS, CostModel, ModelPreset
from pdserve.sim.executor import SimExecutor
from pdserve.scheduler.capacity import single_request_pages, sliding_request_pages
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.planner import Planner, RejectedRequest
from pdserve.scheduler.request import BlockPrompt, Request, SamplingLimits

MODEL, GPU = "gemma-3-27b", "h100"
PAGE = 16                  # tokens per page
CHUNK = 2048               # chunked-prefill budget a round (engine.max_scheduled_tokens)
PROMPTS = (8 * 1024, 32 * 1024, 128 * 1024)
VLLM_32K = 0.192           # vLLM's paged figure at 32K (shared/research/hybrid-cache.md §5)
ENGINES = 8                # fused engines in the trace runs (4 cannot keep up: see docs)
TRACE_LIMIT = 300


def _capacity_cfg(page_size: int, chunk: int) -> EngineConfig:
    return EngineConfig(page_size=page_size, max_scheduled_tokens=max(chunk, page_size))


def request_pages(model: ModelPreset, prompt: int, sliding: bool = True,
                  page_size: int = PAGE, chunk: int = 1) -> list[int]:
    """Pages one request of `prompt` tokens holds in each cache group while it
    computes `chunk` tokens (1: decoding)."""
    cfg = _capacity_cfg(page_size, chunk)
    return [sliding_request_pages(cfg, g.window, chunk) if g.sliding
            else single_request_pages(cfg, prompt) for g in model.groups(sliding)]


def page_bytes(model: ModelPreset, sliding: bool = True, page_size: int = PAGE) -> list[int]:
    return [b * page_size for b in model.group_kv_bytes_per_token(model.groups(sliding))]


def request_bytes(model: ModelPreset, prompt: int, sliding: bool = True,
                  page_size: int = PAGE, chunk: int = 1) -> int:
    return sum(n * b for n, b in zip(request_pages(model, prompt, sliding, page_size, chunk),
                                     page_bytes(model, sliding, page_size)))


def retention_ratio(model: ModelPreset, prompt: int, page_size: int = PAGE,
                    chunk: int = 1) -> float:
    """Bytes a request holds with sliding groups over what it holds with every
    layer's history, decoding (chunk 1) or computing a chunk of `chunk`."""
    return request_bytes(model, prompt, True, page_size, chunk) / \
        request_bytes(model, prompt, False, page_size, chunk)


def ideal_ratio(model: ModelPreset, prompt: int) -> float:
    """The same with no paging: full layers keep the prompt, sliding layers
    its last W - 1 tokens (research §5: 18.7% for Gemma 3 27B at 32K)."""
    kept = model.full_layers * prompt + model.sliding_layers * min(model.window - 1, prompt)
    return kept / (model.layers * prompt)


@dataclass(frozen=True)
class Split:
    sliding: bool
    page_bytes: list         # one page of each group
    per_request: list        # pages a resident (decoding) request holds in each group
    pool_pages: list         # each group's pool
    requests: int            # the most resident at once

    @property
    def request_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.per_request, self.page_bytes))

    @property
    def pool_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.pool_pages, self.page_bytes))


def split_pools(model: ModelPreset, pool_bytes: float, prompt: int, sliding: bool = True,
                page_size: int = PAGE, chunk: int = CHUNK) -> Split:
    """The split of `pool_bytes` between the groups' pools that holds the most
    requests of `prompt` tokens at once (see the module docstring)."""
    groups = model.groups(sliding)
    pb = page_bytes(model, sliding, page_size)
    per = request_pages(model, prompt, sliding, page_size)
    peak = request_pages(model, prompt, sliding, page_size, chunk)
    # the prefill in flight: a sliding group holds a chunk beyond a resident's
    extra = [pk - p if g.sliding else 0 for g, p, pk in zip(groups, per, peak)]
    fixed = sum(e * b for e, b in zip(extra, pb))
    n = max(0, int((pool_bytes - fixed) // sum(p * b for p, b in zip(per, pb))))
    pools = [max(n * p + e, pk) if g.sliding else 0
             for g, p, e, pk in zip(groups, per, extra, peak)]
    left = pool_bytes - sum(n * b for n, b in zip(pools, pb))
    pools[0] += int(left // pb[0])          # the rest to the first group (full history)
    if sum(n * b for n, b in zip(pools, pb)) > pool_bytes:
        n, pools = 0, [0] * len(groups)     # not even one request's working set fits
    return Split(sliding, pb, per, pools, n)


# ---- the planner, run -------------------------------------------------------

def planner_peak(model: ModelPreset, split: Split, prompt: int, page_size: int = PAGE,
                 chunk: int = CHUNK, extra: int = 2, max_rounds: int = 20_000):
    """Submit split.requests + `extra` requests of `prompt` tokens (distinct,
    nothing shared) to a fused planner with the split's pools and run it until
    nobody more gets in. Returns (peak requests holding pages at once, the
    most pages each pool had out, a note). The full pool is capped below one
    more prompt than the arithmetic allows, so the leftover bytes cannot hide
    a shortfall; safe_steps=1 so admission reserves the prompt and decode
    slot, as the arithmetic does; generations never end within the run."""
    groups = model.groups(split.sliding)
    pools = list(split.pool_pages)
    if not pools[0]:
        return 0, [0] * len(pools), "no pool holds one request"
    full = [i for i, g in enumerate(groups) if not g.sliding]
    if full:
        f = full[0]
        pools[f] = min(pools[f], (split.requests + 1) * split.per_request[f] - 1)
    slide = [n for g, n in zip(groups, pools) if g.sliding]
    cfg = EngineConfig(page_size=page_size, total_pages=pools[full[0]] if full else pools[0],
                       sliding_pages=slide[0] if slide else 0, max_scheduled_tokens=chunk,
                       max_batch_size=256, safe_steps=1,
                       # a prompt of the whole context still needs room to decode
                       max_context_tokens=max(model.context, prompt + 1024))
    planner = Planner(cfg, Role.FUSED, groups=groups)
    sim = SimExecutor(CostModel(model, GPUS[GPU]), page_size,
                      group_page_bytes=model.group_page_bytes(groups, page_size))
    blocks = -(-prompt // 512)
    try:
        for i in range(split.requests + extra):
            planner.submit(Request(f"q{i}", BlockPrompt([(-1 - i, b) for b in range(blocks)],
                                                        prompt, 512),
                                   SamplingLimits(max_new_tokens=None)))
    except RejectedRequest:
        return 0, [0] * len(pools), "rejected"
    patience = 2 * -(-prompt // chunk) + 8
    peak, used, still, waiting, note = 0, [0] * len(pools), 0, len(planner.waiting), ""
    coord = planner.coord
    for _ in range(max_rounds):
        plan = planner.build()
        if plan.is_empty():
            break
        planner.apply(plan, sim.run(plan))
        if plan.retracts:
            note = "retracted"
            break
        peak = max(peak, len(planner.prefilling) + len(planner.running))
        used = [max(u, grp.pool.total - coord.available_pages(g))
                for g, (u, grp) in enumerate(zip(used, coord.groups))]
        still = still + 1 if len(planner.waiting) == waiting else 0
        waiting = len(planner.waiting)
        if not waiting or still > patience:
            break
    planner.check_invariants()
    return peak, used, note


# ---- the trace, simulated ---------------------------------------------------

def trace_config(model_name: str, gpu_name: str, split: Split, engines: int = ENGINES,
                 chunk: int = CHUNK) -> ServeConfig:
    model = MODELS[model_name]
    groups = model.groups(split.sliding)
    slide = [n for g, n in zip(groups, split.pool_pages) if g.sliding]
    engine = EngineConfig(page_size=PAGE, total_pages=split.pool_pages[0],
                          sliding_pages=slide[0] if slide else 0, max_scheduled_tokens=chunk,
                          max_batch_size=256, max_context_tokens=model.context)
    return ServeConfig(engine=engine, cluster=ClusterShape(prefill=0, decode=0, fused=engines),
                       simulate=SimulateConfig(gpu=gpu_name, model=model_name,
                                               sliding_groups=split.sliding))


def run_trace(cfg: ServeConfig, trace) -> dict:
    t0 = time.perf_counter()
    sim = Simulation(cfg, trace, progress=False)
    res = sim.run()
    rows = [r for r in res["requests"] if r["status"] == "finished"]
    ttft = [r["ttft_s"] for r in rows]
    tpot = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    s = res["summary"]
    return {"finished": s["finished"], "rejected": s["rejected"],
            "unfinished": s["unfinished"] + s["failed"],
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "tpot_p50_s": percentile(tpot, 0.5), "tpot_p90_s": percentile(tpot, 0.9),
            "output_tok_per_s": s["output_tok_per_s"], "peak_resident": sim.peak_resident,
            "retractions": sum(r["retractions"] for r in res["requests"]),
            "wall_s": time.perf_counter() - t0}


# ---- the report -------------------------------------------------------------

def _k(n: int) -> str:
    return f"{n // 1024}K"


def main(trace_path: str | None = None, limit: int | None = None,
         prompts=PROMPTS, verify: bool = True) -> int:
    model, gpu = MODELS[MODEL], GPUS[GPU]
    pool = kv_pool_bytes(model, gpu)
    full_l, slide_l = model.layer_kinds()
    print(f"{MODEL} ({len(slide_l)} sliding layers, window {model.window}, + {len(full_l)} full; "
          f"KV {model.kv_layer_bytes // 1024} KiB/token/layer) on one {GPU}: KV pool = "
          f"{gb(gpu.hbm_bytes)} GB HBM - {gb(model.weight_bytes_total)} GB bf16 weights - "
          f"{OVERHEAD:.0%} of HBM for activations = {gb(pool)} GB (assumed)")
    print(f"pages of {PAGE} tokens; chunk budget {CHUNK}; a page costs "
          f"{page_bytes(model)[0] / 2**20:.2f} MiB full-history, "
          f"{page_bytes(model)[1] / 2**20:.2f} MiB sliding, "
          f"{page_bytes(model, False)[0] / 2**20:.2f} MiB with every layer full")
    print()
    _per_request_table(model, pool, prompts, verify)
    _trace_table(model, pool, trace_path, limit)
    return 0


def _per_request_table(model: ModelPreset, pool: float, prompts, verify: bool) -> None:
    """A row per prompt length and cache: what a resident request holds, and
    how many the pool holds (with `verify`, checked on the planner)."""
    print("Per request (resident, decoding): pages and GB per group, and the most requests "
          "the pool holds")
    print(f"{'prompt':>6} {'cache':<13} {'full pg':>7} {'full GB':>7} {'slide pg':>8} "
          f"{'slide GB':>8} {'GB/req':>6} {'ratio':>6} {'ideal':>6} {'prefill':>7} "
          f"{'pools (pages)':>16} {'max reqs':>8} {'planner':>8}")
    for prompt in prompts:
        for sliding in (True, False):
            print(_request_row(model, pool, prompt, sliding, verify))
    r32 = retention_ratio(model, 32 * 1024)
    print(f"ratio: a request's bytes with sliding groups over every layer full, decoding; "
          f"prefill: while computing a {CHUNK}-token chunk; ideal: no paging, W - 1 tokens per "
          f"sliding layer. At 32K: {r32:.1%} against the ideal "
          f"{ideal_ratio(model, 32 * 1024):.1%} (goal: within 2 points; vLLM {VLLM_32K:.1%})")
    print("planner: peak requests holding pages when N + 2 prompts are submitted to a fused "
          "planner with those pools (full pool capped below N + 1 prompts; every generation "
          "still running)")


def _request_row(model: ModelPreset, pool: float, prompt: int, sliding: bool,
                 verify: bool) -> str:
    sp = split_pools(model, pool, prompt, sliding)
    per, pb = sp.per_request, sp.page_bytes
    if sliding:
        ratio = f"{retention_ratio(model, prompt):.1%}"
        ideal = f"{ideal_ratio(model, prompt):.1%}"
        pre = f"{retention_ratio(model, prompt, chunk=CHUNK):.1%}"
        slide = f"{per[1]:>8} {gb(per[1] * pb[1]):>8}"
        pools = "/".join(str(n) for n in sp.pool_pages)
    else:
        ratio = ideal = pre = "100%"
        slide = f"{'-':>8} {'-':>8}"
        pools = str(sp.pool_pages[0])
    peak = "-"
    if verify:
        n, _, note = planner_peak(model, sp, prompt)
        peak = f"{n}" + (f" ({note})" if note else "")
    name = "sliding" if sliding else "every layer"
    return (f"{_k(prompt):>6} {name:<13} {per[0]:>7} {gb(per[0] * pb[0]):>7} {slide} "
            f"{gb(sp.request_bytes):>6} {ratio:>6} {ideal:>6} {pre:>7} {pools:>16} "
            f"{sp.requests:>8} {peak:>8}")


def _trace_table(model: ModelPreset, pool: float, trace_path: str | None,
                 limit: int | None) -> None:
    """The trace simulated both ways, each engine's pool split for its mean
    prompt."""
    path = str(trace_file(trace_path, MOONCAKE_CONV))
    trace = read_trace(path, limit=TRACE_LIMIT if limit is None else limit)
    lengths = [len(t.prompt) for t in trace]  # type: ignore[arg-type]
    mean = int(sum(lengths) / len(lengths))
    print()
    print(f"{len(trace)} requests of {Path(path).name} (mean prompt {mean:,} tokens, "
          f"longest {max(lengths):,}) on {ENGINES} fused {GPU}s, each {gb(pool)} GB of KV "
          f"split for the mean prompt")
    print(f"{'cache':<13} {'pools (pages)':>16} {'fin':>5} {'rej':>4} {'TTFT p50':>9} "
          f"{'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} {'tok/s':>7} {'peak':>5} "
          f"{'retract':>7} {'wall s':>6}")
    for sliding in (True, False):
        sp = split_pools(model, pool, mean, sliding)
        r = run_trace(trace_config(MODEL, GPU, sp), trace)
        name = "sliding" if sliding else "every layer"
        print(f"{name:<13} {'/'.join(str(n) for n in sp.pool_pages):>16} {r['finished']:>5} "
              f"{r['rejected']:>4} {s_or_ms(r['ttft_p50_s']):>9} {s_or_ms(r['ttft_p90_s']):>9} "
              f"{s_or_ms(r['tpot_p50_s'], True):>9} {s_or_ms(r['tpot_p90_s'], True):>9} "
              f"{r['output_tok_per_s']:>7.0f} {r['peak_resident']:>5} {r['retractions']:>7} "
              f"{r['wall_s']:>6.0f}")
    print("peak: most requests holding pages on one engine; rej: prompts one engine's pool "
          "can never hold")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="the trace simulated both ways (default the Mooncake "
                                   "conversation trace in ../shared/data/traces)")
    p.add_argument("--limit", type=int,
                   help=f"only the first N requests of the trace ({TRACE_LIMIT})")


def run(args) -> int:
    return main(args.trace, args.limit)
