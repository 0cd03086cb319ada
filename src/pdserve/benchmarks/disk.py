"""`pdserve bench disk`: the disk (L3) tier on the CPU engine, side by side.

A multi-turn replay: `--conversations` conversations of `--turns` turns,
each turn adding `--turn-tokens` tokens to its conversation's prompt and
asking for one token (its time is the request's TTFT, one request at a
time). Turns go round-robin, so a conversation's prefix must outlive the
others' turns; the device and host tiers hold fewer conversations than
there are, so without the disk the later turns recompute it. Three
comparisons, each alternating its two sides over `--repeats` runs:

  replay       host tier alone against host + disk: TTFT of turns 2 and on
  restart      an engine started on the directory the replay filled (warm)
               against one on an empty directory (cold): the last turns
  all-miss     prompts that share nothing, disk tier on against off: the
               cost of probing and writing when nothing is ever found
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.benchmarks.args import positive


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="the model preset (default "
                   "smollm2-135m; tiny for a smoke run)")
    p.add_argument("--conversations", type=positive, default=4)
    p.add_argument("--turns", type=positive, default=3)
    p.add_argument("--turn-tokens", type=positive, default=128)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a fresh "
                   "one under /dev/shm, else the system's temporary directory)")


def run(args) -> int:
    return main(args.preset, args.conversations, args.turns, args.turn_tokens, args.repeats,
                args.dir)


class Bench:
    """One loaded model; engines built on it as the configuration asks."""

    def __init__(self, preset: str, engine: dict):
        from pdserve import LLM

        self.llm = LLM({"model": {"preset": preset}, "engine": engine})
        self.base = self.llm.engine_config

    def engine(self, disk: str | None):
        """A fresh engine (a restart: empty device and host tiers) with the
        disk tier on `disk`, or none."""
        from pdserve.roles.engine import Engine
        from pdserve.roles.torch_executor import TorchExecutor
        from pdserve.scheduler.config import DiskCacheConfig
        from pdserve.scheduler.planner import Planner

        old = getattr(self.llm, "executor", None)
        if old is not None:
            old.close()
        cfg = dataclasses.replace(self.base, disk_cache=DiskCacheConfig(
            path=disk, prefetch_policy="wait_complete") if disk else None)
        ex = TorchExecutor(self.llm.model, self.llm.tokenizer, cfg)
        self.llm.executor = ex
        self.llm.engine = Engine("fused-0", Planner(cfg, groups=ex.groups), ex,
                                 forget_finished=False)
        return self.llm

    def ttft(self, prompts) -> list[float]:
        """Each prompt alone, one token out: its time."""
        from pdserve import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0)
        out = []
        for p in prompts:
            t0 = time.perf_counter()
            self.llm.generate([p], sp, use_tqdm=False)
            out.append(time.perf_counter() - t0)
        return out


def conversations(n: int, turns: int, tokens: int, vocab: int, seed: int = 0) -> list:
    """Per turn, every conversation's prompt at that turn."""
    rng = random.Random(seed)
    convs = [[] for _ in range(n)]
    out = []
    for _ in range(turns):
        for c in convs:
            c.extend(rng.randrange(3, vocab) for _ in range(tokens))
        out.append([list(c) for c in convs])
    return out


def main(preset: str, n: int, turns: int, tokens: int, repeats: int,
         directory: str | None) -> int:
    ps = 16
    final = turns * tokens
    # device and host hold about two conversations' prompts each: fewer than there are
    pages = -(-final // ps)
    engine = {"page_size": ps, "total_pages": 2 * pages + 8, "host_pages": 2 * pages,
              "max_scheduled_tokens": max(512, final)}
    b = Bench(preset, engine)
    vocab = b.llm.model.cfg.vocab_size
    replay = conversations(n, turns, tokens, vocab)
    later = [p for turn in replay[1:] for p in turn]
    misses = conversations(n * turns, 1, final // 2, vocab, seed=1)[0]
    root = Path(directory) if directory else Path(tempfile.mkdtemp(
        dir="/dev/shm" if Path("/dev/shm").is_dir() else None, prefix="pdserve-disk-"))
    print(f"{preset}: {n} conversations x {turns} turns of {tokens} tokens (final prompt "
          f"{final}); device {engine['total_pages']} pages, host {engine['host_pages']} pages "
          f"of {ps}; disk tier at {root}; {repeats} repeats, sides alternated", flush=True)
    res: dict[str, list] = {k: [] for k in ("host", "disk", "cold", "warm", "off", "on")}
    disk_hits = []
    for rep in range(repeats):
        for side in (("host", "disk") if rep % 2 == 0 else ("disk", "host")):
            d = root / f"replay-{rep}"
            if side == "disk":
                shutil.rmtree(d, ignore_errors=True)
            llm = b.engine(str(d) if side == "disk" else None)
            t = b.ttft(replay[0])                       # the first turns fill the tiers
            t = b.ttft(later)
            res[side].append(statistics.median(t))
            if side == "disk":
                disk_hits.append(llm.engine.planner.hits.disk_tokens)
                llm.executor.disk.flush()
        # restart: the last turns on an engine started on the filled directory, or an empty one
        for side in (("cold", "warm") if rep % 2 == 0 else ("warm", "cold")):
            d = root / (f"replay-{rep}" if side == "warm" else f"empty-{rep}")
            shutil.rmtree(root / f"empty-{rep}", ignore_errors=True)
            b.engine(str(d))
            res[side].append(sum(b.ttft(replay[-1])))
        # all-miss: prompts sharing nothing
        for side in (("off", "on") if rep % 2 == 0 else ("on", "off")):
            d = root / f"miss-{rep}"
            shutil.rmtree(d, ignore_errors=True)
            b.engine(str(d) if side == "on" else None)
            res[side].append(statistics.median(b.ttft(misses)))
        for d in root.glob("*"):
            shutil.rmtree(d, ignore_errors=True)
        print(f"  repeat {rep + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms"
                                                   for k, v in res.items()), flush=True)
    if not directory:
        shutil.rmtree(root, ignore_errors=True)

    def cell(k: str) -> str:
        v = res[k]
        return f"{statistics.median(v) * 1e3:,.0f} ms ({min(v) * 1e3:,.0f}-{max(v) * 1e3:,.0f})"

    def ratio(a: str, c: str) -> str:
        r = [x / y for x, y in zip(res[a], res[c])]
        return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"

    print(f"\n| comparison | A | B | B / A |\n| --- | --- | --- | --- |")
    print(f"| replay, turns 2+: median TTFT, host alone (A) vs host + disk (B) | "
          f"{cell('host')} | {cell('disk')} | {ratio('disk', 'host')} |")
    print(f"| restart, last turns: total time, cold (A) vs warm (B) | {cell('cold')} | "
          f"{cell('warm')} | {ratio('warm', 'cold')} |")
    print(f"| all-miss prompts: median TTFT, tier off (A) vs on (B) | {cell('off')} | "
          f"{cell('on')} | {ratio('on', 'off')} |")
    print(f"\nmedian (min-max) over {repeats} repeats; disk hit tokens in the replay: "
          f"{disk_hits}")
    return 0
