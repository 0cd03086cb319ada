"""`pdserve bench serve`: load a running deployment (or start one per
--config, side by side in one run) through the gRPC client library and/or
the OpenAI HTTP API (`--api grpc grpc-many http`: all on the same
deployment, interleaved `--repeats` times, so a drift of the machine hits
each). `grpc` is a `Generate` stream per request; `grpc-many` multiplexes
the requests over `GenerateMany` streams (`AsyncClient(multiplex=True)`).

Workload: N synthetic prompts, or a replayed trace (Mooncake JSONL or Azure
CSV from shared/data/traces, lengths capped to what the model can take).
Arrivals, and where each request's clock starts:
- closed loop (synthetic prompts, no `--rate`): a request starts when one of
  `--concurrency` workers picks it up; its clock starts then.
- open loop: Poisson at `--rate` req/s (seeded), or a trace's own arrival
  times (`--trace` without `--rate`; `--rate` replaces them). A request's
  clock starts at its scheduled arrival, not when a worker is free, so time
  spent queued behind `--concurrency` busy workers counts in its TTFT and E2E
  (no coordinated omission: a saturated server cannot hide its queue).
Reports TTFT, TPOT, ITL and E2E percentiles, the queueing delay and
throughput, prints a table and saves JSON.

The load generator should cost as little CPU as it can, since on a small
host it shares the cores with what it measures: every load is one asyncio
loop, the gRPC loads through `AsyncClient` over a few connections, the HTTP
load through aiohttp with a keep-alive connection per concurrent stream.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.common.options import (add_model_arguments, client_key,
                                               client_key_argument, flags_from, positive,
                                               usage_error, workload_arguments)
from pdserve.benchmarks.common.processes import served
from pdserve.benchmarks.common.tables import ms
from pdserve.config import Flags
from pdserve.sim.load import Sample, arrivals, drive, workload


OFFLINE_QUIET_CORES = 0.2   # other processes' load the offline row waits to fall under


def _compare(name: str, addresses: dict, samples, concurrency, rate, seed, repeats: int,
             api_key: str | None = None, connections: int = 1):
    """Each API on the same deployment, interleaved `repeats` times; the
    run with the median throughput of each stands for it."""
    runs: dict[str, list] = {api: [] for api in addresses}
    for _ in range(repeats):
        for api, addr in addresses.items():
            runs[api].append(drive(addr, samples, concurrency, rate, seed, api=api,
                                   api_key=api_key, connections=connections))
    out = []
    for api, rs in runs.items():
        rs = sorted(rs, key=lambda r: r["output_tok_per_s"])
        best = dict(rs[len(rs) // 2])
        best["tok_per_s_runs"] = [r["output_tok_per_s"] for r in rs]
        best["ttft_p50_runs"] = sorted(r["ttft_s"]["p50"] or 0 for r in rs)
        out.append((f"{name} [{api}]", best))
    return out


def main(address: str | None, configs: list[str], n: int, prompt_len: int, max_tokens: int,
         concurrency: int, rate: float | None, trace: str | None, limit: int | None,
         max_prompt: int, out: str | None, seed: int = 0, apis=("grpc",),
         http_address: str | None = None, repeats: int = 1, offline: bool = False,
         api_key: str | None = None, connections: int | None = None,
         control_planes=("secure",)) -> int:
    """`connections`: gRPC connections each load opens (default: the
    config's router.replicas; 1 against --address). `control_planes`: each
    config is started once per mode listed (secure: mutual TLS between the
    router and the engines; insecure: `--insecure-control-plane`)."""
    samples = workload(n, prompt_len, max_tokens, trace, limit, max_prompt, seed)
    load = Load(samples, concurrency, rate, seed, repeats)
    results = []
    if http_address and "://" not in http_address:
        http_address = "http://" + http_address
    if address or http_address:
        addrs = {a: (http_address if a == "http" else address) for a in apis}
        missing = [a for a, v in addrs.items() if not v]
        if missing:
            raise ValueError(f"bench serve --api {' '.join(apis)} against a running deployment "
                             "needs --address (gRPC) and --http-address (HTTP)")
        results += _compare(address or http_address, addrs, samples, concurrency, rate, seed,  # type: ignore[arg-type]
                            repeats, api_key, connections or 1)

    def warm() -> list[Sample]:
        return workload(min(4, n), prompt_len, max_tokens, None, None, max_prompt,  # type: ignore[arg-type]
                        seed + 1)
    results += _started(configs, control_planes, apis, load, warm, connections, offline)
    _print_results(results, load)
    _print_comparisons(results)
    if out:
        with open(out, "w") as f:
            json.dump({name: r for name, r in results}, f, indent=1)
    return 0 if all(r["failed"] == 0 for _, r in results) else 1


@dataclass(frozen=True)
class Load:
    """The requests every target gets, and how they arrive."""
    samples: list[Sample]
    concurrency: int
    rate: float | None          # Poisson arrivals a second; None: closed loop or the trace's
    seed: int
    repeats: int                # runs of each API, interleaved


def _started(configs: list[str], control_planes, apis, load: Load, warm, connections,
             offline: bool) -> list:
    """Each config started once per control-plane mode (`pdserve up` in a
    child process), warmed on `warm()`'s prompts and loaded through each
    API; with `offline`, then the same requests through pdserve.LLM."""
    from pdserve.config import load_config

    results = []
    for path, mode in [(c, m) for c in configs for m in control_planes]:
        conns = connections or load_config(path).router.replicas
        up_args = ["--insecure-control-plane"] if mode == "insecure" else []
        label = path if len(control_planes) == 1 else f"{path} {mode}"
        with served(path, http="http" in apis, up_args=up_args) as (addr, http_url):
            addrs = {a: (http_url if a == "http" else addr) for a in apis}
            for api, a in addrs.items():          # warm both paths on prompts not measured
                drive(a, warm(), load.concurrency, None, load.seed, progress=False, api=api,
                      connections=conns)
            results += _compare(label, addrs, load.samples, load.concurrency, load.rate,
                                load.seed, load.repeats, connections=conns)
        if offline and mode == control_planes[-1]:
            from pdserve.sim.host_load import wait_for_quiet

            # the deployment's processes take seconds to go: the engine's own
            # rate is measured once they are gone, as the served rows ran alone
            wait_for_quiet(OFFLINE_QUIET_CORES, window_s=2.0, timeout_s=60.0)
            results.append((f"{path} [offline LLM]",
                            run_offline(path, load.samples, load.seed, load.concurrency,
                                        load.repeats)))
    return results


def _print_results(results: list, load: Load) -> None:
    """The table: a row per target and API, its errors and runs below it."""
    samples, rate = load.samples, load.rate
    mode = arrivals(samples, rate, load.seed)
    print(f"{len(samples)} requests, concurrency {load.concurrency}, "
          + (f"Poisson arrivals at {rate:.2f} req/s" if rate else
             f"the trace's arrivals over {max(mode):.1f} s" if mode is not None else
             "closed loop")
          + ("; TTFT and E2E from each scheduled arrival, queueing included"
             if mode is not None else ""))
    print(f"{'target':<30} {'ok':>4} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'ITL p99':>8} {'E2E p50':>8}")
    for name, r in results:
        print(f"{name[-30:]:<30} {r['ok']:>4} {r['req_per_s']:>6.2f} {r['output_tok_per_s']:>7.1f} "
              f"{ms(r['ttft_s']['p50']):>9} {ms(r['ttft_s']['p99']):>9} "
              f"{ms(r['tpot_s']['p50']):>9} {ms(r['itl_s']['p99']):>8} {ms(r['e2e_s']['p50']):>8}")
        for err in r["errors"]:
            print(f"  error: {err}")
        if len(r.get("tok_per_s_runs", ())) > 1:
            print(f"  {len(r['tok_per_s_runs'])} runs: tok/s " +
                  " ".join(f"{v:.1f}" for v in r["tok_per_s_runs"]) +
                  ("; TTFT p50 " + " ".join(ms(v) for v in r["ttft_p50_runs"])
                   if r.get("ttft_p50_runs") else ""))


def _print_comparisons(results: list) -> None:
    """Each API against gRPC on the same target, and each served row
    against its config's offline row."""
    by_name = dict(results)
    for name, r in results:
        target, _, api = name[:-1].rpartition(" [")
        g = by_name.get(f"{target} [grpc]")
        if api in ("http", "grpc-many") and g is not None:
            label = "HTTP" if api == "http" else "GenerateMany"
            print(f"{target}: {label}/gRPC throughput "
                  f"{r['output_tok_per_s'] / g['output_tok_per_s']:.3f}, TTFT p50 "
                  f"{(r['ttft_s']['p50'] - g['ttft_s']['p50']) * 1000:+.2f} ms")
        base = name.rsplit(" [", 1)[0] + " [offline LLM]"
        if base in by_name and name != base:
            print(f"{name}: {r['output_tok_per_s'] / by_name[base]['output_tok_per_s']:.1%} "
                  "of the offline rate")
            step, tpot = by_name[base]["tpot_s"]["p50"], r["tpot_s"]["p50"]
            if step is not None and tpot is not None:
                print(f"{name}: TPOT p50 {tpot * 1000:.1f} ms against the engine's own decode "
                      f"round {step * 1000:.1f} ms: the served path adds "
                      f"{(tpot - step) * 1000:+.1f} ms a token")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append",
                   help="config YAML: start this deployment (repeat to compare); the model "
                        "flags below go over each, as `pdserve up` takes them (model flags "
                        "alone: over up's default config)")
    add_model_arguments(p)
    p.add_argument("--address", help="a running deployment's router")
    p.add_argument("--http-address", help="a running deployment's HTTP API, "
                                          "e.g. http://127.0.0.1:8000")
    client_key_argument(p)
    p.add_argument("--api", nargs="+", choices=["grpc", "grpc-many", "http"], default=["grpc"],
                   help="the client APIs to load (several: side by side, interleaved); "
                        "grpc-many: requests multiplexed over GenerateMany streams")
    p.add_argument("--offline", action="store_true",
                   help="also run the same requests through pdserve.LLM in-process (each "
                        "--config), the engine's own rate: at most --concurrency at once, "
                        "--repeats times, at the served engine's torch threads; its TPOT "
                        "column is the median decode-only round, which each served row's "
                        "TPOT is compared with")
    p.add_argument("--connections", type=positive,
                   help="gRPC connections each gRPC load spreads its streams over (default: "
                        "the config's router.replicas, 1 against --address)")
    p.add_argument("--repeats", type=positive, default=1,
                   help="runs of each API; the median is reported with the spread")
    workload_arguments(p)
    p.add_argument("--trace", help="replay this trace (Mooncake JSONL or Azure CSV) instead of "
                                   "synthetic prompts, lengths capped")
    p.add_argument("--limit", type=int,
                   help="only the first N requests of the trace (default --requests)")
    p.add_argument("--max-prompt", type=int, default=1024,
                   help="cap replayed prompts at this many tokens (1024)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    p.add_argument("--rate", type=float, help="Poisson arrivals a second")
    p.add_argument("--out", help="save the results as JSON here")
    p.add_argument("--control-plane", nargs="+", choices=["secure", "insecure"],
                   default=["secure"],
                   help="start each --config once per mode, side by side: secure (mutual TLS "
                        "between router and engines, the default) and/or insecure "
                        "(--insecure-control-plane)")


def run(args) -> int:
    from pdserve.config import UP_CONFIG

    flags = flags_from(args)
    configs = args.config or ([UP_CONFIG] if flags != Flags() else [])
    if not args.address and not configs and not args.http_address:
        return usage_error("bench serve needs --address HOST:PORT or --config FILE (or "
                           "--model PATH; repeat --config to compare deployments)")
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-serve-") as folder:
        if flags != Flags():
            configs = [with_model_flags(c, flags, Path(folder) / f"{i}-{Path(c).stem}.yaml")
                       for i, c in enumerate(configs)]
        return main(args.address, configs, args.requests, args.prompt_len,
                    args.max_tokens, args.concurrency, args.rate, args.trace, args.limit,
                    args.max_prompt, args.out, apis=args.api, http_address=args.http_address,
                    repeats=args.repeats, offline=args.offline, api_key=client_key(args),
                    connections=args.connections, control_planes=tuple(args.control_plane))


def with_model_flags(config: str, flags: Flags, path: Path) -> str:
    """`config` with the model flags over it, saved as `path`: the file the
    deployment (`pdserve up --config`) and the offline row both start from."""
    import yaml

    from pdserve.config import load_with_flags

    _, merged = load_with_flags(config, flags)
    path.write_text(yaml.safe_dump(merged, sort_keys=False))
    print(f"bench serve: {config} with the model flags is {path}:\n"
          f"{yaml.safe_dump(merged, sort_keys=False)}", end="", flush=True)
    return str(path)


def run_offline(config: str, samples: list[Sample], seed: int,
                concurrency: int | None = None, repeats: int = 1) -> dict:
    """The same requests through `pdserve.LLM` in this process: the engine's
    own rate, the ceiling the served rows are measured against. With
    `concurrency`, at most that many run at once (the engine's
    max_batch_size), as in the served closed loop: a batch of 128 runs
    faster per token than two of 64, so comparing a served closed loop of 64
    against all requests at once would understate the served share. The
    run with the median rate of `repeats` stands for it: on a shared
    two-core host the same offline run moved from 12,100 to 20,050 tok/s
    between minutes."""
    import torch

    from pdserve.cluster.cpu_threads import served_threads
    from pdserve.config import load_config
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.llm import LLM

    # the served engine's threads (engine.cpu_threads), not torch's default
    before = torch.get_num_threads()
    torch.set_num_threads(served_threads(load_config(config), "fused"))
    try:
        return _offline_runs(config, samples, seed, concurrency, repeats)
    finally:
        torch.set_num_threads(before)


def _offline_runs(config: str, samples: list[Sample], seed: int, concurrency: int | None,
                  repeats: int) -> dict:
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.llm import LLM

    llm = LLM(config) if concurrency is None else LLM(config, max_batch_size=concurrency)
    llm.generate([s.prompt for s in samples[:4]], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(max_tokens=s.max_tokens, temperature=1.0, ignore_eos=True,
                             seed=seed + i) for i, s in enumerate(samples)]
    none = {"p50": None, "p90": None, "p99": None}
    runs = []
    for _ in range(repeats):
        steps = DecodeSteps(llm.engine)
        t0 = time.perf_counter()
        outs = llm.generate([s.prompt for s in samples], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps.close()
        tokens = sum(len(o.token_ids) for o in outs)
        runs.append({"requests": len(samples), "ok": len(outs), "failed": 0, "wall_s": wall,
                     "req_per_s": len(outs) / wall, "output_tok_per_s": tokens / wall,
                     "ttft_s": none, "tpot_s": steps.percentiles(), "itl_s": steps.percentiles(),
                     "e2e_s": none, "errors": []})
    runs.sort(key=lambda r: r["output_tok_per_s"])  # type: ignore[arg-type, return-value]
    return {**runs[len(runs) // 2], "tok_per_s_runs": [r["output_tok_per_s"] for r in runs]}


class DecodeSteps:
    """The wall time of each decode-only round an offline engine runs while
    it is attached: what a token costs the engine itself, the floor under
    a served stream's inter-token latency (its TPOT and ITL columns)."""

    def __init__(self, engine):
        self.engine = engine
        self.seconds: list[float] = []
        self._step = engine.step
        engine.step = self._timed          # this instance only, until close()

    def _timed(self):
        t0 = time.perf_counter()
        out = self._step()
        if out is not None and out.plan.decodes and not out.plan.prefills:
            self.seconds.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.engine.step = self._step

    def percentiles(self) -> dict:
        s = sorted(self.seconds)
        if not s:
            return {"p50": None, "p90": None, "p99": None}
        return {f"p{q}": s[min(len(s) - 1, len(s) * q // 100)] for q in (50, 90, 99)}
