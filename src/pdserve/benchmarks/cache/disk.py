"""`pdserve bench disk`: the disk (L3) tier on the CPU engine, side by side.

A multi-turn replay: `--conversations` conversations of `--turns` turns,
each turn adding `--turn-tokens` tokens to its conversation's prompt and
asking for one token (its time is the request's TTFT, one request at a
time). Turns go round-robin, so a conversation's prefix must outlive the
others' turns; the device and host tiers hold fewer conversations than
there are, so without the disk the later turns recompute it. Three
comparisons, each alternating its two sides over `--repeats` runs:

  replay       host tier alone against host + disk: TTFT of turns 2 and on
               (and host + disk with the store's one FIFO worker, as before
               reads had a lane of their own)
  restart      an engine started on the directory the replay filled (warm)
               against one on an empty directory (cold): the last turns
  all-miss     prompts that share nothing, disk tier on against off: the
               cost of probing and writing when nothing is ever found

The sides of a comparison are alive at once and take each prompt in turn,
the order rotated prompt by prompt, so a busy machine slows every side
alike; B / A is the median of the per-prompt ratios. A side's disk writes
run in its own turns only (the others' write lanes are paused), so each
side meets the write backlog it would meet alone and spends no CPU in the
others' time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.tables import median_range

PARTS = ("replay", "restart", "all-miss")
STORE = "read-behind-writes"      # the store alone; not part of the default run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="the model preset (default "
                   "smollm2-135m; tiny for a smoke run)")
    p.add_argument("--conversations", type=positive, default=4)
    p.add_argument("--turns", type=positive, default=3)
    p.add_argument("--turn-tokens", type=positive, default=128)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a fresh "
                   "one under /dev/shm, else the system's temporary directory)")
    p.add_argument("--only", choices=PARTS + (STORE,), action="append", default=None,
                   help="run these comparisons only (repeatable; default: the three on the "
                   f"engine; {STORE}: a read's latency behind a write backlog, the store's "
                   "lanes against one FIFO worker)")
    p.add_argument("--backlog", type=positive, default=64, help=f"{STORE}: pages queued to "
                   "write before the read (64)")
    p.add_argument("--page-kib", type=positive, default=720, help=f"{STORE}: a page's size "
                   "(720 KiB: SmolLM2-135M, float32, 16 tokens)")
    p.add_argument("--sim", action="store_true", help="instead: the Mooncake conversation "
                   "trace in the simulator, host alone against host + disk")
    p.add_argument("--trace", default=None, help="--sim: a Mooncake-format trace (default: "
                   "the conversation trace in ../shared/data/traces)")
    p.add_argument("--limit", type=positive, default=3000, help="--sim: requests from the "
                   "start of the trace (3000)")
    p.add_argument("--disk-gib", type=float, default=512.0, help="--sim: the disk tier's "
                   "size (GiB, 512)")


def run(args) -> int:
    if args.sim:
        return sim_main(args.trace, args.limit, args.disk_gib, args.repeats)
    if args.only == [STORE]:
        return store_main(args.backlog, args.page_kib * 1024, args.repeats, args.dir)
    return main(args.preset, args.conversations, args.turns, args.turn_tokens, args.repeats,
                args.dir, set(args.only or PARTS))


class Bench:
    """One loaded model; engines built on it as a side asks, several alive
    at once, each request timed on the engine `use` picked."""

    def __init__(self, preset: str, engine: dict):
        from pdserve import LLM

        self.llm = LLM({"model": {"preset": preset}, "engine": engine})
        self.base = self.llm.engine_config
        self.llm.executor.close()
        self.made: list = []

    def engine(self, disk: str | None, lanes: bool = True):
        """A fresh engine (empty device and host tiers) with the disk tier
        on directory `disk` (`lanes=False`: its store's one FIFO worker, as
        before reads had their own), or none: (executor, engine)."""
        from pdserve.engine.disk.tier import DiskTier
        from pdserve.engine.engine import Engine
        from pdserve.engine.executor.torch_executor import TorchExecutor
        from pdserve.scheduler.config import DiskCacheConfig, PrefetchPolicy
        from pdserve.scheduler.planner import Planner
        from pdserve.transfer.disk.files import FileStore

        dc = DiskCacheConfig(path=disk, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE) \
            if disk else None
        cfg = dataclasses.replace(self.base, disk_cache=dc)
        tier = None
        if dc is not None:
            m = self.llm.model
            tier = DiskTier.open(dc, m, cfg.page_size, m.new_caches([1], cfg.page_size)[0].layout())
            tier.store.close()
            tier.store = FileStore(dc.path, dc.max_bytes, lanes=lanes)
        ex = TorchExecutor(self.llm.model, self.llm.tokenizer, cfg, disk=tier)
        side = (ex, Engine("fused-0", Planner(cfg, groups=ex.groups), ex, forget_finished=False))
        self.made.append(ex)
        return side

    def close(self) -> None:
        for ex in self.made:
            if ex.disk is not None:
                ex.disk.store.pause_writes(False)
            ex.close()
        self.made = []

    def ttft(self, side, prompt) -> tuple[float, float]:
        """`prompt` alone on `side`, one token out: (its time, the process
        CPU it took)."""
        from pdserve import SamplingParams

        for ex in self.made:            # other engines' writes wait for their own turns
            if ex.disk is not None:
                ex.disk.store.pause_writes(ex is not side[0])
        self.llm.executor, self.llm.engine = side
        sp = SamplingParams(max_tokens=1, temperature=0)
        cpu0, t0 = time.process_time(), time.perf_counter()
        self.llm.generate([prompt], sp, use_tqdm=False)
        return time.perf_counter() - t0, time.process_time() - cpu0


def conversations(n: int, turns: int, tokens: int, vocab: int, seed: int = 0) -> list:
    """Per turn, every conversation's prompt at that turn."""
    rng = random.Random(seed)
    convs: list[list[int]] = [[] for _ in range(n)]
    out = []
    for _ in range(turns):
        for c in convs:
            c.extend(rng.randrange(3, vocab) for _ in range(tokens))
        out.append([list(c) for c in convs])
    return out


def interleaved(b: Bench, sides: dict, prompts, res: dict, timed: bool = True,
                cpu: dict | None = None) -> None:
    """Each prompt on every side in turn, the order rotated prompt by prompt
    (what the machine does meanwhile falls on every side alike); each
    side's times appended to `res[name]` (`cpu`: its CPU to `cpu[name]`)."""
    names = list(sides)
    for i, prompt in enumerate(prompts):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            wall, c = b.ttft(sides[name], prompt)
            if timed:
                res[name].append(wall)
                if cpu is not None:
                    cpu[name].append(c)


class Figures:
    """Each side's median per repeat and each comparison's median of
    per-prompt ratios per repeat, and the table they make."""

    def __init__(self):
        self.meds: dict[str, list] = {}     # side -> the median of each repeat
        self.ratios: dict[str, list] = {}   # "b/a" -> per repeat, the median of per-prompt ratios
        self.disk_hits: list[int] = []      # disk hit tokens in each repeat's replay

    def record(self, res: dict, pairs) -> None:
        for k, v in res.items():
            self.meds.setdefault(k, []).append(statistics.median(v))
        for num, den in pairs:
            r = [x / y for x, y in zip(res[num], res[den])]
            self.ratios.setdefault(f"{num}/{den}", []).append(statistics.median(r))

    def cell(self, k: str) -> str:
        return median_range(self.meds[k], ",.0f", " ms", 1e3) if self.meds.get(k) else "-"

    def ratio(self, k: str) -> str:
        return median_range(self.ratios[k], ".2f", "x") if self.ratios.get(k) else "-"

    def print_table(self, repeats: int) -> None:
        cell, ratio = self.cell, self.ratio
        print("\n| comparison | A | B | B / A |\n| --- | --- | --- | --- |")
        print(f"| replay, turns 2+: median TTFT, host alone (A) vs host + disk (B) | "
              f"{cell('host')} | {cell('disk')} | {ratio('disk/host')} |")
        print(f"| replay, turns 2+: the same, the store's one FIFO worker (before) as B | "
              f"{cell('host')} | {cell('disk_fifo')} | {ratio('disk_fifo/host')} |")
        print(f"| restart, last turns: median TTFT, cold (A) vs warm (B) | {cell('cold')} | "
              f"{cell('warm')} | {ratio('warm/cold')} |")
        print(f"| all-miss prompts: median TTFT, tier off (A) vs on (B) | {cell('off')} | "
              f"{cell('on')} | {ratio('on/off')} |")
        print(f"| all-miss prompts: process CPU a request (on: its writes included), off (A) vs "
              f"on (B) | {cell('off_cpu')} | {cell('on_cpu')} | {ratio('on_cpu/off_cpu')} |")
        print(f"\nmedian (min-max) over {repeats} repeats of each side's median; B / A: the "
              f"median of per-prompt ratios; disk hit tokens in the replay: {self.disk_hits}")


def main(preset: str, n: int, turns: int, tokens: int, repeats: int,
         directory: str | None, parts=frozenset(PARTS)) -> int:
    ps = 16
    final = turns * tokens
    # device and host hold about one conversation's prompt each: together
    # fewer than there are, so a turn's prefix is gone from both by its next turn
    pages = -(-final // ps)
    engine = {"page_size": ps, "total_pages": pages + 8, "host_pages": pages,
              "max_scheduled_tokens": max(512, final)}
    b = Bench(preset, engine)
    vocab = b.llm.model.cfg.vocab_size
    replay = conversations(n, turns, tokens, vocab)
    misses = conversations(n * turns, 1, final // 2, vocab, seed=1)[0]
    root = Path(directory) if directory else Path(tempfile.mkdtemp(
        dir="/dev/shm" if Path("/dev/shm").is_dir() else None, prefix="pdserve-disk-"))
    print(f"{preset}: {n} conversations x {turns} turns of {tokens} tokens (final prompt "
          f"{final}); device {engine['total_pages']} pages, host {engine['host_pages']} pages "
          f"of {ps}; disk tier at {root}; {repeats} repeats; the sides of a comparison "
          f"alive at once, each prompt on each side in rotated order", flush=True)
    b.ttft(b.engine(None), misses[0])   # warm up: no side pays the first call's costs
    b.close()
    figures = Figures()
    for rep in range(repeats):
        _repeat(b, root, rep, parts, replay, misses, figures)
        for d in root.glob("*"):
            shutil.rmtree(d, ignore_errors=True)
        print(f"  repeat {rep + 1} (load average {os.getloadavg()[0]:.1f}): " + ", ".join(
            f"{k} {v[-1] * 1e3:.0f} ms" for k, v in figures.meds.items()), flush=True)
    if not directory:
        shutil.rmtree(root, ignore_errors=True)
    figures.print_table(repeats)
    return 0


def _repeat(b: Bench, root: Path, rep: int, parts, replay: list, misses: list,
            figures: Figures) -> None:
    """One repeat of each comparison in `parts`, its sides alive at once;
    the restart reads the disk tier the replay filled."""
    fill = root / f"replay-{rep}"
    if "replay" in parts or "restart" in parts:
        sides = {"host": b.engine(None), "disk": b.engine(str(fill)),
                 "disk_fifo": b.engine(str(root / f"fifo-{rep}"), lanes=False)}
        res: dict[str, list] = {k: [] for k in sides}
        interleaved(b, sides, replay[0], res, timed=False)   # the first turns fill the tiers
        interleaved(b, sides, [p for turn in replay[1:] for p in turn], res)
        figures.disk_hits.append(sides["disk"][1].planner.hits.disk_tokens)
        b.close()                                           # writes finish, then a restart
        if "replay" in parts:
            figures.record(res, [("disk", "host"), ("disk_fifo", "host")])
    if "restart" in parts:
        sides = {"cold": b.engine(str(root / f"empty-{rep}")), "warm": b.engine(str(fill))}
        res = {k: [] for k in sides}
        interleaved(b, sides, replay[-1], res)
        b.close()
        figures.record(res, [("warm", "cold")])
    if "all-miss" in parts:
        sides = {"off": b.engine(None), "on": b.engine(str(root / f"miss-{rep}"))}
        res = {k: [] for k in sides}
        cpu: dict[str, list] = {k: [] for k in sides}
        interleaved(b, sides, misses, res, cpu=cpu)     # on's writes run in its turns
        b.close()
        figures.record(res | {f"{k}_cpu": v for k, v in cpu.items()},
                       [("on", "off"), ("on_cpu", "off_cpu")])


# ---- the store alone: a read behind the write backlog --------------------------------

def store_main(backlog: int, page_bytes: int, repeats: int, directory: str | None) -> int:
    """A file store with `backlog` pages queued to write, then one GET of a
    page already on disk: the time until the GET's completion, with the
    store's lanes against one FIFO worker, alternated."""
    from pdserve.transfer.disk.files import FileStore
    from pdserve.transfer.disk.store import DiskKey, DiskOp

    root = Path(directory) if directory else Path(tempfile.mkdtemp(
        dir="/dev/shm" if Path("/dev/shm").is_dir() else None, prefix="pdserve-store-"))
    page = os.urandom(page_bytes)
    got: dict[bool, list] = {True: [], False: []}
    print(f"a GET behind {backlog} queued PUTs of {page_bytes / 1024:,.0f} KiB pages in "
          f"{root}; {repeats} repeats, the two stores alternated", flush=True)
    for rep in range(repeats):
        for lanes in ((True, False) if rep % 2 == 0 else (False, True)):
            d = root / f"{'lanes' if lanes else 'fifo'}-{rep}"
            store = FileStore(d, max_bytes=(backlog + 2) * (page_bytes + 4096), lanes=lanes)
            key = DiskKey(0, 0, "bench", "float32", "kv")
            store.wait(store.submit(DiskOp.PUT, key, page))
            for i in range(backlog):
                store.submit(DiskOp.PUT, DiskKey(i + 1, 0, "bench", "float32", "kv"), page)
            t0 = time.perf_counter()
            done = store.wait(store.submit(DiskOp.GET, key), timeout_s=600)
            got[lanes].append(time.perf_counter() - t0)
            assert done is not None and done.ok
            store.close()
            shutil.rmtree(d, ignore_errors=True)
    if not directory:
        shutil.rmtree(root, ignore_errors=True)

    def cell(v: list) -> str:
        return median_range(v, ",.1f", " ms", 1e3)
    r = [a / b for a, b in zip(got[False], got[True])]
    print(f"\n| store | a GET behind {backlog} queued writes |\n| --- | --- |")
    print(f"| one FIFO worker (before) | {cell(got[False])} |")
    print(f"| reads and writes on separate lanes | {cell(got[True])} |")
    print(f"\nFIFO / lanes: {statistics.median(r):,.0f}x ({min(r):,.0f}-{max(r):,.0f}); "
          f"load average {os.getloadavg()[0]:.1f}")
    return 0


# ---- the simulator: the Mooncake conversation trace ---------------------------------

SIM_CONFIG = "sim-mooncake-tight-host.yaml"


def sim_main(trace_path: str | None, limit: int, disk_gib: float, repeats: int) -> int:
    """The conversation trace on the shipped tight-host config, host alone
    against host + a disk tier of `disk_gib` GiB shared by the node's
    engines: prompt tokens found cached by tier against the trace's own
    bound (everything kept), TTFT p50 and p90."""
    from pdserve.benchmarks.cache.bounds import ideal_hit
    from pdserve.benchmarks.common.traces import MOONCAKE_CONV, trace_file
    from pdserve.config import load_config, shipped
    from pdserve.scheduler.config import DiskCacheConfig
    from pdserve.sim.report import percentile
    from pdserve.sim.simulation import Simulation
    from pdserve.sim.trace import read_trace

    trace = read_trace(trace_file(trace_path, MOONCAKE_CONV), limit=limit)
    cfg = load_config(shipped(SIM_CONFIG))
    total, bound = ideal_hit(trace)
    disk = DiskCacheConfig(path="simulated", max_bytes=int(disk_gib * 2 ** 30))
    e = cfg.engine
    print(f"the first {len(trace)} Mooncake conversation requests on {SIM_CONFIG}: "
          f"{cfg.cluster.fused} fused engines, {e.total_pages:,} device and {e.host_pages:,} "
          f"host pages of {e.page_size} each; disk {disk_gib:g} GiB shared, read "
          f"{cfg.simulate.disk_read_gbps:g} Gb/s")
    print(f"\n| tiers | device % | host % | disk % | all % | bound % | TTFT p50 s | "
          f"TTFT p90 s | finished | wall s |\n| --- | --- | --- | --- | --- | --- | --- | "
          f"--- | --- | --- |")
    for name, dc in (("device + host", None), ("device + host + disk", disk)):
        walls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = Simulation(dataclasses.replace(cfg, engine=dataclasses.replace(
                e, disk_cache=dc)), trace, progress=False).run()
            walls.append(time.perf_counter() - t0)
        tiers = res["cached_tokens_by_tier"]
        p = tiers["prompt_tokens"] or 1
        ttft = sorted(r["ttft_s"] for r in res["requests"] if r["ttft_s"] is not None)
        shares = [100 * tiers[k] / p for k in ("device", "host", "disk")]
        print(f"| {name} | " + " | ".join(f"{s:.1f}" for s in shares) +
              f" | {sum(shares):.1f} | {100 * bound / total:.1f} | "
              f"{percentile(ttft, 0.5):.3f} | {percentile(ttft, 0.9):.3f} | "
              f"{res['summary']['finished']} | {statistics.median(walls):.1f} |", flush=True)
    return 0
