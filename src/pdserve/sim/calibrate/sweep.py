"""`pdserve calibrate`: time the real engine's rounds and fit a cost profile.

The config's model is loaded in this process as an engine loads it (same
dtype, attention backend, device, engine settings) and driven by the real
planner through a grid of rounds:

- chunk sweep: one prompt cut into chunks of each size in `chunks`, so the
  chunks start at every context from 0 up (prefill tokens x context);
- decode sweep: for each context L in `contexts` and batch B in `batches`,
  B requests of L tokens decode together (they share all but their last
  page, so only one prompt is computed whole); then one fresh prompt joins
  them, a mixed round of a chunk and B decodes.

Each round's wall time is the engine's step (plan build, forward, sampling,
apply), with the plan's features (sim/cost/profile.py). The fit
(sim/cost/fit.py) minimizes the sum of |predicted / measured - 1|,
every coefficient >= 0. Every 4th round is held out of the fit and its
error reported.

Copies (`copies` > 1): the sweep runs twice, first with the host to itself
(the fit), then with copies - 1 processes sweeping the same grid beside it;
the second sweep's median measured/fitted ratio, less one, per copy, is the
profile's `neighbour_slowdown` (sim/cost/profile.py), which the
simulator applies while other engines compute.

Threads: a CPU engine under Ray runs one intra-op thread (Ray sets
OMP_NUM_THREADS=1 in an actor without CPUs), so `threads` defaults to 1 on
CPU: the profile then describes one engine as a deployment runs it. Its
C kernels (kernels/cpu/pool.c) share their work among cores as a served
engine's and `pdserve.LLM`'s do (`engine.cpu_threads`, by default every
core the process may run on); before 2026-12-06 the sweep ran them on one
core, so on the 2-core host its SmolLM2 profile priced an in-process
engine's rounds 67% slower than they ran (under the CPU clock they still
run on one, the thread it times). Clock:
wall time by default (what a deployment sees); `clock="cpu"` takes the
thread's CPU time instead, the round's cost with a core to itself, which a
machine other work shares still measures (memory and cache contention
aside).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass

from pdserve.config import ServeConfig, engine_for_model
from pdserve.sim.host_load import ForeignLoad
from pdserve.sim.cost.fit import HOLD_OUT_EVERY, fit, held_out_report, neighbour_slowdown
from pdserve.sim.cost.roofline import ModelPreset
from pdserve.sim.cost.profile import TERMS, Profile, Round, round_of



@dataclass(frozen=True)
class Grid:
    chunks: tuple              # prefill chunk sizes (engine.max_scheduled_tokens of a stage)
    batches: tuple             # decode batch sizes
    contexts: tuple            # decode context lengths; the chunk sweep reaches the largest
    decode_rounds: int = 4     # pure decode rounds timed per (batch, context)

    @classmethod
    def for_engine(cls, cfg, chunks=None, batches=None, contexts=None,
                   decode_rounds: int = 4) -> "Grid":
        """Defaults from the engine's own bounds: chunks page_size x 4^k up
        to max_scheduled_tokens, batches 4^k up to max_batch_size (64 at
        most), contexts 64, 256, 1024 (within half the context limit)."""
        s, ps = cfg.max_scheduled_tokens, cfg.page_size
        if chunks is None:
            chunks = sorted({c for c in _geometric(ps, s)} | {s})
        if batches is None:
            top = min(cfg.max_batch_size, 64)
            batches = sorted(set(_geometric(1, top)) | {top})
        if contexts is None:
            contexts = [c for c in (64, 256, 1024) if c <= cfg.max_context_tokens // 2] or \
                [cfg.max_context_tokens // 2]
        for name, vals, top, bound in (
                ("chunks", chunks, s, "engine.max_scheduled_tokens"),
                ("batches", batches, cfg.max_batch_size, "engine.max_batch_size"),
                ("contexts", contexts, cfg.max_context_tokens - 64,
                 "the context limit less 64 decode tokens")):
            bad = [v for v in vals if v < 1 or v > top]
            if bad:
                raise ValueError(f"calibrate --{name} {bad[0]} is outside [1, {top}] ({bound}); "
                                 "lower it, or raise that setting in the config")
        if decode_rounds < 1:
            raise ValueError(f"calibrate --decode-rounds must be >= 1, got {decode_rounds}")
        return cls(tuple(chunks), tuple(batches), tuple(contexts), decode_rounds)


def _geometric(start: int, top: int, step: int = 4):
    v = start
    while v <= top:
        yield v
        v *= step


class Harness:
    """One executor (the model and its KV pools), a fresh planner per stage;
    every engine round is timed and recorded."""

    def __init__(self, model, tokenizer, engine_cfg, seed: int = 0, clock: str = "wall"):
        """`clock`: "wall" (perf_counter), or "cpu": this thread's CPU time,
        which leaves out the time other processes held the core (a CPU
        engine of one thread computes on the calling thread)."""
        from pdserve.engine.executor.torch_executor import TorchExecutor

        self.model = model
        self.cfg = engine_cfg
        self.executor = TorchExecutor(model, tokenizer, engine_cfg, detokenize=False)
        self.window = next((g.window for g in self.executor.groups if g.sliding), 0)
        self.rng = random.Random(seed)
        self.rounds: list[Round] = []
        self.engine = None
        self._next = 0
        self._clock = time.thread_time if clock == "cpu" else time.perf_counter

    def stage(self, **overrides) -> None:
        from pdserve.engine.engine import Engine
        from pdserve.scheduler.planner import Planner

        if self.engine is not None:
            self.drain()
        cfg = dataclasses.replace(self.cfg, **overrides)
        self.engine = Engine("calibrate", Planner(cfg, groups=self.executor.groups),  # type: ignore[assignment]
                             self.executor)

    def tokens(self, n: int) -> list:
        vocab = self.model.cfg.vocab_size
        return [self.rng.randrange(vocab) for _ in range(n)]

    def submit(self, prompt: list, max_new: int):
        from pdserve.text.sampling_params import SamplingParams
        from pdserve.scheduler.request import Request, SamplingLimits

        rid = f"cal-{self._next}"
        self._next += 1
        sp = SamplingParams(max_tokens=max_new, temperature=1.0, ignore_eos=True)
        self.executor.register(rid, sp, fallback_seed=self._next, prompt=prompt)
        req = Request(rid, prompt, SamplingLimits(max_new_tokens=max_new))
        self.engine.submit(req)  # type: ignore[attr-defined]
        return req

    def step(self, record: bool = True):
        t0 = self._clock()
        out = self.engine.step()  # type: ignore[attr-defined]
        dt = self._clock() - t0
        if out is None:
            raise RuntimeError("calibrate: the planner built an empty round with work left; "
                               f"stalls: {self.engine.planner.stalls}")  # type: ignore[attr-defined]
        if out.failed:
            raise RuntimeError(f"calibrate: a round failed: {out.error}")
        if record:
            self.rounds.append(round_of(out.plan, dt, self.window))
        return out

    def step_until(self, done, limit: int = 10_000) -> None:
        for _ in range(limit):
            if done():
                return
            self.step()
        raise RuntimeError("calibrate: a stage did not reach its state; this is a bug")

    def drain(self) -> None:
        """End the stage: abort what is live, forget it."""
        pl = self.engine.planner  # type: ignore[attr-defined]
        for rid in list(pl.requests):
            pl.abort(rid, "calibration stage over")
            self.executor.forget(rid)
        pl.assert_idle()


def chunk_sweep(h: Harness, grid: Grid, progress) -> None:
    top = max(grid.contexts)
    for c in grid.chunks:
        h.stage(max_scheduled_tokens=c)
        length = max(c, min(top + c, 64 * c) // c * c)
        req = h.submit(h.tokens(length), 1)
        h.step_until(lambda: not h.engine.has_work() or req.output)  # type: ignore[attr-defined]
        progress(f"chunks of {c}")


def decode_sweep(h: Harness, grid: Grid, progress) -> None:
    ps, s = h.cfg.page_size, h.cfg.max_scheduled_tokens
    for ctx in grid.contexts:
        for b in grid.batches:
            h.stage(max_batch_size=max(b + 1, h.cfg.max_batch_size))
            tail = min(ps, ctx)
            shared = h.tokens(ctx - tail)
            # enough tokens that the first is still decoding when the timed rounds end
            new = grid.decode_rounds + 8 + -(-b * tail // s)
            first = h.submit(shared + h.tokens(tail), new)
            h.step_until(lambda: first.output)
            reqs = [first] + [h.submit(shared + h.tokens(tail), new) for _ in range(b - 1)]
            h.step_until(lambda: all(r.output for r in reqs))
            for _ in range(grid.decode_rounds):
                h.step()
            h.submit(h.tokens(min(s, 4 * ctx)), 1)      # one chunk beside the decodes
            h.step()
            progress(f"batch {b} at context {ctx}")


def model_facts(model, name: str) -> ModelPreset:
    """The KV shape the simulator needs, read off the loaded model."""
    c = model.cfg
    sliding = [g for g in model.cache_groups() if g.sliding]
    windows = {g.window for g in sliding}
    if len(windows) > 1:
        raise ValueError(f"model {name} has sliding layers of several windows {sorted(windows)}; "
                         "a cost profile describes one window")
    params = 0
    for v in vars(model).values():
        params += _numel(v)
    # a MoE token runs top_k of each sparse layer's experts: the rest are idle weights
    idle = len(c.moe.sparse_layers) * (c.moe.num_experts - c.moe.top_k) * 3 * \
        c.hidden_size * c.moe.intermediate if c.moe is not None else 0
    return ModelPreset(name, float(params), c.num_layers, c.num_heads, c.num_kv_heads,
                       c.head_dim, c.max_position, dtype_bytes=model.dtype.itemsize,
                       sliding_layers=sum(len(g.layers) for g in sliding),
                       window=windows.pop() if windows else 0, kv_parts=c.kv_parts,
                       active_params=float(params - idle) if idle else 0.0)


def _numel(v, seen=None) -> int:
    import torch

    from pdserve.kernels.cpu.quantized import QuantizedLinear

    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, QuantizedLinear):          # its weights once, not copy + packed + scales
        return v.out_features * v.in_features
    if isinstance(v, (list, tuple)):
        return sum(_numel(x) for x in v)
    if isinstance(v, dict):
        return sum(_numel(x) for x in v.values())
    if hasattr(v, "__dict__") and type(v).__module__.startswith("pdserve.kernels"):
        return sum(_numel(x) for x in vars(v).values())
    return 0


def copy_bandwidth(device, repeats: int = 5) -> float:
    """Bytes/s of a 64 MiB device-to-host copy (the median of `repeats`)."""
    import torch

    src = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty(64 << 20, dtype=torch.uint8, device="cpu")
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return src.numel() / times[len(times) // 2]


def calibrate(cfg: ServeConfig, grid_args: dict | None = None, device: str | None = None,
              threads: int | None = None, seed: int = 0, progress: bool = True,
              source: str = "", clock: str = "wall", copies: int = 1,
              as_load: bool = False) -> tuple[Profile, list[Round], dict]:
    """(profile, every timed round, the fit's held-out report). `clock`:
    see `Harness`. `copies` > 1: after the fit, time the sweep again with
    copies - 1 processes sweeping the same grid beside this one, for the
    profile's neighbour_slowdown. `as_load`: be such a copy (sweep from a
    line on stdin until killed; returns nothing)."""
    import torch

    device = cfg.model.device_for(device)
    if threads is None:
        threads = 1 if device == "cpu" else torch.get_num_threads()
    if clock not in ("wall", "cpu"):
        raise ValueError(f"calibrate --clock is {clock!r}; use wall or cpu")
    if clock == "cpu" and (device != "cpu" or threads != 1):
        raise ValueError(f"calibrate --clock cpu times the calling thread, so it needs device "
                         f"cpu and --threads 1 (got {device}, {threads} threads); use "
                         "--clock wall")
    if copies > 1 and not source:
        raise ValueError("calibrate with copies > 1 needs `source`, the config file the "
                         "copies load")
    torch.set_num_threads(threads)
    workers = 1
    if device == "cpu":     # pdserve's C kernels share cores as an engine's do; the CPU clock
        from pdserve.cluster.cpu_threads import share_kernel_cores  # counts one thread alone

        workers = share_kernel_cores(cfg.engine.cpu_threads if clock == "wall" else 1)
    started = time.perf_counter()
    neighbours = _start_copies(source, copies - 1, device, threads, seed, grid_args or {})
    try:
        out = _calibrate(cfg, grid_args, device, threads, seed, progress, source, clock,
                         neighbours, as_load, started)
        if out is not None:
            out[0].measured["kernel_workers"] = workers
        return out
    finally:
        for p in neighbours:
            p.terminate()
            p.wait()


def _start_copies(config: str, n: int, device: str, threads: int, seed: int,
                  grid_args: dict) -> list:
    import subprocess

    argv = [sys.executable, "-m", "pdserve.cli.main", "calibrate", "--config", config,
            "--out", os.devnull, "--device", device, "--threads", str(threads), "--as-load"]
    for key in ("chunks", "batches", "contexts"):
        if grid_args.get(key):
            argv += [f"--{key}", *map(str, grid_args[key])]
    if grid_args.get("decode_rounds"):
        argv += ["--decode-rounds", str(grid_args["decode_rounds"])]
    return [subprocess.Popen(argv + ["--seed", str(seed + 1 + i)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for i in range(n)]


def _warm_up(h, engine_cfg) -> None:
    """First forwards allocate and (on a GPU) compile: run a few, unrecorded."""
    h.stage()
    warm = h.submit(h.tokens(min(engine_cfg.max_scheduled_tokens, 64)), 4)
    while h.engine.has_work() and len(warm.output) < 4:
        h.step(record=False)


def _sweep_as_load(h, grid) -> None:
    """A copy that loads the machine for `--neighbours`: ready, then on "go"
    sweep unrecorded until the calibrating process stops it or dies."""
    print("ready", flush=True)
    parent = os.getppid()
    if not sys.stdin.readline():     # "go": the calibrating process swept alone
        return                       # it is gone
    while os.getppid() == parent:
        chunk_sweep(h, grid, lambda _: None)
        decode_sweep(h, grid, lambda _: None)
        h.rounds.clear()


def _sweep_beside(h, grid, neighbours, say) -> list:
    """The same sweep again while every copy sweeps too; its rounds ([]
    without copies)."""
    if not neighbours:
        return []
    h.rounds = []
    for p in neighbours:             # the copies sweep from here on
        p.stdin.write("go\n")
        p.stdin.flush()
    say(f"fitted; the same sweep again beside {len(neighbours)} copies")
    chunk_sweep(h, grid, say)
    decode_sweep(h, grid, say)
    h.drain()
    return h.rounds


def _calibrate(cfg, grid_args, device, threads, seed, progress, source, clock, neighbours,
               as_load, started):
    import torch

    from pdserve.kernels.models.loader import load_model

    m = cfg.model
    model, tok = load_model(m.path, m.preset, dtype=m.dtype, device=device,
                            attention=m.attention, quantization=m.quantization)
    engine_cfg = engine_for_model(cfg.engine, cfg.engine_overrides, model.cfg.max_position)
    grid = Grid.for_engine(engine_cfg, **(grid_args or {}))
    facts = model_facts(model, m.served_name)
    h = Harness(model, tok, engine_cfg, seed, clock)

    def say(what: str) -> None:
        if progress:
            print(f"pdserve calibrate: {what} ({len(h.rounds)} rounds, "
                  f"{time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    _warm_up(h, engine_cfg)
    if as_load:
        _sweep_as_load(h, grid)
        return None
    for p in neighbours:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"calibrate: a copy (pid {p.pid}) ended before it was ready; "
                               "run it alone to see why")
    with ForeignLoad() as load:
        chunk_sweep(h, grid, say)
        decode_sweep(h, grid, say)
    h.drain()
    rounds = h.rounds
    train = [r for i, r in enumerate(rounds) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    held = [r for i, r in enumerate(rounds) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    cost = fit(train, facts)
    report = held_out_report(cost, held, facts)
    shared = _sweep_beside(h, grid, neighbours, say)
    slowdown = neighbour_slowdown(cost, shared, facts, len(neighbours)) if shared else 0.0
    measured = {
        "config": source, "model": m.served_name, "device": device,
        "dtype": str(model.dtype).removeprefix("torch."), "threads": threads, "clock": clock,
        "copies": 1 + len(neighbours),
        "torch": str(torch.__version__), "rounds": len(rounds), "held_out": len(held),
        "held_out_error": report,
        "grid": {"chunks": list(grid.chunks), "batches": list(grid.batches),
                 "contexts": list(grid.contexts), "decode_rounds": grid.decode_rounds},
        "seconds": round(time.perf_counter() - started, 1),
        # CPU other processes used meanwhile (a shared machine slows the rounds)
        "foreign_cores": None if load.cores is None else round(load.cores, 2),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if shared:
        measured["rounds_beside_copies"] = len(shared)
    return Profile(cost, facts, copy_bandwidth(model.device), measured, slowdown), \
        rounds + shared, report


FORM = ("# round seconds = overhead_s + multi_token_s * M + prefill_chunk_s * C\n"
        "#   + prefill_token_s * P + prefill_pair_s * Q + decode_s * D + decode_context_s * K\n"
        "# M: 1 if the round computes more than one token; C: prefill chunks; P: the\n"
        "# tokens they compute; Q: their query x key pairs (a chunk of n tokens from\n"
        "# position b: n * (b + (n + 1) / 2)); D: decoding requests; K: the sum of their\n"
        "# context lengths. neighbour_slowdown: a round takes (1 + it x n) times as long\n"
        "# while n other engines compute. served_factors (calibrate --served): measured /\n"
        "# form by round kind, decode batch and alone (0) or beside others (1), used in\n"
        "# place of (1 + it x n) where a round has a cell. Use it with\n"
        "# `simulate: {profile: THIS_FILE}`.\n")


def main(*, config: str, out: str, device: str | None, threads: int | None, chunks, batches,
         contexts, decode_rounds: int, seed: int = 0, rounds_out: str | None = None,
         clock: str = "wall", copies: int = 1, as_load: bool = False,
         served: bool = False) -> int:
    from pdserve.config import load_config
    from pdserve.sim.cost.profile import save_profile

    cfg = load_config(config)
    grid_args = {"chunks": chunks, "batches": batches, "contexts": contexts,
                 "decode_rounds": decode_rounds}
    if as_load:
        calibrate(cfg, grid_args, device, threads, seed, False, config, as_load=True)
        return 0
    if served:
        from pdserve.sim.calibrate.served import calibrate_served

        profile, rounds, report = calibrate_served(cfg, config, seed, grid_args=grid_args,
                                                   sweep=calibrate)
    else:
        profile, rounds, report = calibrate(cfg, grid_args, device, threads, seed,
                                            source=config, clock=clock, copies=copies)
    save_profile(profile, out, header=f"# pdserve cost profile of {config}, written by "
                                      f"`pdserve calibrate`\n" + FORM)
    if rounds_out:
        with open(rounds_out, "w") as f:
            for r in rounds:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    ms = profile.measured
    how = "served by the deployment" if served else \
        f"{ms['threads']} thread(s), {clock} clock, {copies} cop{'y' if copies == 1 else 'ies'}"
    print(f"pdserve calibrate: {ms['model']} on {ms['device']} ({ms['dtype']}, {how}): "
          f"{len(rounds)} rounds in {ms['seconds']:.0f} s; profile in {out}")
    if ms["foreign_cores"] is not None:
        print(f"  other processes used {ms['foreign_cores']:.2f} cores meanwhile")
    for t, v in zip(TERMS, profile.round.coefficients()):
        print(f"  {t:<17} {v:.4g}")
    if served:
        sv = ms["served"]
        print(f"  neighbour_slowdown {profile.neighbour_slowdown:.4g}; the sweep's form x "
              f"{sv['scale']:.3f} (fitted on {sv['rounds'] - sv['held_out']} served rounds, "
              f"{sv['alone']} of all {sv['rounds']} began with no other engine computing)")
        print("  served factors (measured / that form; kind, decode batch from, beside others):")
        for (kind, b, beside), f in sorted(profile.served_factors.items()):
            print(f"    {kind:<8} {b:>3} {'beside' if beside else 'alone':<7} {f:.3f}")
    if copies > 1:
        print(f"  neighbour_slowdown {profile.neighbour_slowdown:.3f} (a round beside "
              f"{copies - 1} cop{'y' if copies == 2 else 'ies'}: "
              f"{1 + profile.neighbour_slowdown * (copies - 1):.3f}x, median of "
              f"{ms['rounds_beside_copies']} rounds)")
    print(f"held-out {'served ' if served else ''}rounds, |predicted/measured - 1|:")
    for kind, s in report.items():
        print(f"  {kind:<8} {s['rounds']:>4} rounds  p50 {s['p50']:.1%}  p90 {s['p90']:.1%}  "
              f"max {s['max']:.1%}")
    if served:
        s = ms["served"]["held_out_error_scale_only"]["all"]
        print(f"  (the scale and neighbour_slowdown alone, no served factors: p50 {s['p50']:.1%}  "
              f"p90 {s['p90']:.1%})")
    return 0
