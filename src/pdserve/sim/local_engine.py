"""The config's one fused engine in this process, under load: no Ray, no
router, no gRPC. What `bench sim-accuracy --in-process` holds the
simulator against where Ray cannot run (the GPU host has none) or where
the serving path's own costs should stay out of the comparison.

`LocalEngine.load` takes the requests `sim.load.drive` takes (a closed
loop, Poisson arrivals or a trace's own times) and returns the same
figures, timed the same way: TTFT from the scheduled arrival (open loop)
or the pick-up (closed loop), each token as the round that made it
returns. `take_rounds` hands over the rounds the engine timed, as a
serving engine's loop times them (engine/loop.py), for the profile to be
held against."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pdserve.engine.rounds import Round, round_of
from pdserve.scheduler.request import Request
from pdserve.sim.load import Sample, Timing, arrivals, summary


class LocalEngineError(ValueError):
    """A config the in-process engine cannot run; says what to change."""


@dataclass
class _Live:
    index: int               # the sample's
    req: Request             # its scheduler request
    start: float             # its clock's zero (perf_counter)
    last: float              # when its previous tokens came


class LocalEngine:
    def __init__(self, cfg):
        """Loads the model and builds the engine (`pdserve.LLM`): a config
        of one fused engine, else a LocalEngineError. On CPU this process's
        torch runs the threads a served engine would (cluster/cpu_threads.py:
        one by default, what `pdserve calibrate` times too)."""
        from pdserve.llm import LLM

        c = cfg.cluster
        if (c.fused, c.prefill, c.decode) != (1, 0, 0):
            raise LocalEngineError(
                f"the in-process engine is one fused engine, and this config's cluster is "
                f"{{prefill: {c.prefill}, decode: {c.decode}, fused: {c.fused}}}; give it "
                "cluster: {fused: 1}, or start the deployment under Ray instead")
        import torch

        from pdserve.cluster.cpu_threads import served_threads

        self._threads = torch.get_num_threads()     # the process's, put back at close
        if cfg.model.device_for() == "cpu":
            torch.set_num_threads(served_threads(cfg, "fused"))
        self.llm = LLM(cfg)
        self._window = next((g.window for g in self.llm.engine.planner.groups if g.sliding), 0)
        self._rounds: list[Round] = []

    def close(self) -> None:
        import torch

        self.llm.close()
        torch.set_num_threads(self._threads)

    def take_rounds(self) -> list[list[Round]]:
        """The rounds timed since the last call (one engine's list)."""
        out, self._rounds = self._rounds, []
        return [out]

    def load(self, samples: list[Sample], concurrency: int, rate: float | None,
             seed: int) -> dict:
        """Run `samples` as `sim.load.drive` sends them: at most
        `concurrency` in the engine at once; arriving at `rate` (Poisson),
        at the samples' own times, or (neither) as a closed loop."""
        from pdserve.text.sampling_params import SamplingParams

        due = arrivals(samples, rate, seed)
        timings = [Timing() for _ in samples]
        order = range(len(samples)) if due is None else \
            sorted(range(len(samples)), key=lambda i: due[i])  # type: ignore[index]
        waiting = deque(order)
        live: dict[str, _Live] = {}
        t0 = time.perf_counter()
        while waiting or live:
            now = time.perf_counter()
            while waiting and len(live) < concurrency and \
                    (due is None or t0 + due[waiting[0]] <= now):
                i = waiting.popleft()
                start = now if due is None else t0 + due[i]
                timings[i].queued = now - start
                sp = SamplingParams(max_tokens=samples[i].max_tokens, temperature=0,
                                    ignore_eos=True)
                try:
                    req = self.llm.add_request(list(samples[i].prompt), sp)
                except ValueError as e:          # refused, as a router would: counted
                    timings[i].error = str(e)
                    continue
                live[req.id] = _Live(i, req, start, start)
            if not live:                       # idle until the next arrival, if any
                if waiting:
                    time.sleep(t0 + due[waiting[0]] - now)  # type: ignore[index]
                continue
            self._round(live, timings)
        wall = time.perf_counter() - t0
        return summary(samples, timings, wall, due, rate)

    def _round(self, live: dict, timings: list[Timing]) -> None:
        """One engine round, timed; the tokens it made, seen; the requests
        it ended, out of `live`."""
        engine = self.llm.engine
        start, t0 = time.time(), time.perf_counter()
        out = engine.step()
        wall = time.perf_counter() - t0
        if out is None:
            raise RuntimeError("the engine built an empty round with requests in it; stalls: "
                               f"{engine.planner.stalls}")
        timed = round_of(out.plan, wall, self._window, start)
        if timed.computed:
            self._rounds.append(timed)
        for lv in live.values():
            t = timings[lv.index]
            lv.last = t.seen(len(lv.req.output) - t.tokens, lv.start, lv.last)
        for req in [*out.finished, *out.failed, *out.aborted]:
            lv = live.pop(req.id)
            t = timings[lv.index]
            t.ok = req in out.finished
            t.error = "" if t.ok else (req.error or out.error or "failed")
            t.e2e = time.perf_counter() - lv.start
            self.llm.executor.forget(req.id)
