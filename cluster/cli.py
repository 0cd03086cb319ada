"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "local-pd.yaml"


def _cmd_sim(args) -> int:
    from pdserve.cluster.config import load_config
    from pdserve.cluster.faults import load_faults
    from pdserve.cluster.sim import Simulation, build_engines, format_summary
    from pdserve.cluster.trace import read_trace

    cfg = load_config(args.config)
    trace = read_trace(args.trace, limit=args.limit)
    faults = []
    if args.faults:
        faults = load_faults(args.faults, [e.name for e in build_engines(cfg)])
    plan_log = None
    if args.plans:
        Path(args.plans).parent.mkdir(parents=True, exist_ok=True)
        plan_log = open(args.plans, "w")
    started = time.perf_counter()
    try:
        sim = Simulation(cfg, trace, plan_log=plan_log, progress=not args.no_progress,
                         all_strict=args.strict, faults=faults)
        result = sim.run()
    finally:
        if plan_log is not None:
            plan_log.close()
    wall = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"pdserve sim: {len(trace)} requests on {len(sim.engines)} engine(s), "
          f"{sim.rounds} rounds, {wall:.1f} s wall; results in {out}")
    print(format_summary(result["summary"]))
    if any(result["counters"].values()):
        print(" ".join(f"{k}={v}" for k, v in result["counters"].items() if v))
    return 0


def _cmd_calibrate(args) -> int:
    from pdserve.cluster.calibrate import main as calibrate_main

    return calibrate_main(args.config, args.out, args.device, args.threads, args.chunks,
                          args.batches, args.contexts, args.decode_rounds, args.seed,
                          args.rounds, args.clock, args.copies, args.as_load)


def _cmd_up(args) -> int:
    import signal
    import threading

    import os

    from pdserve.cluster.config import engine_gpus, load_config

    cfg = load_config(args.config)
    device = cfg.model.device_for(args.device)
    gpus = engine_gpus(device, args.gpus_per_engine)    # refused before Ray starts
    from pdserve.cluster.deploy import Deployment
    from pdserve.cluster.router import Security

    if bool(args.tls_cert) != bool(args.tls_key):
        print("pdserve: error: --tls-cert and --tls-key go together; give both or neither",
              file=sys.stderr)
        return 2
    for path in (args.tls_cert, args.tls_key):
        if path and not Path(path).is_file():
            print(f"pdserve: error: TLS file {path!r} does not exist", file=sys.stderr)
            return 2
    key = args.api_key or os.environ.get("PDSERVE_API_KEY") or None
    dep = Deployment(cfg, address=args.address, device=device, gpus_per_engine=gpus,
                     security=Security(key, args.tls_cert, args.tls_key))
    addr = dep.start(host=args.host, port=args.port, http_port=args.http_port)
    http = f", OpenAI HTTP on {dep.http_address}" if dep.http_address else ""
    print(f"pdserve: serving gRPC on {addr}{http} ({cfg.cluster.prefill} prefill, "
          f"{cfg.cluster.decode} decode, {cfg.cluster.fused} fused; model "
          f"{cfg.model.served_name}); Ctrl-C stops", flush=True)
    done = threading.Event()

    def on_term(*_):
        if done.is_set():
            raise KeyboardInterrupt           # a second SIGTERM: stop without waiting
        done.set()
    signal.signal(signal.SIGTERM, on_term)
    rc = 0
    try:
        try:
            done.wait()
        except KeyboardInterrupt:
            done.set()
        print(f"pdserve: draining every engine (at most {args.drain_deadline:g} s, then what "
              "is left is aborted); Ctrl-C again stops at once", flush=True)
        for name, how in dep.drain(args.drain_deadline).items():
            print(f"pdserve: {name}: {how}", flush=True)
    except KeyboardInterrupt:
        print("pdserve: stopping without waiting for the drain", flush=True)
    except Exception as e:                    # the drain broke: say so, still stop
        print(f"pdserve: error: the drain failed ({type(e).__name__}: {e}); stopping",
              file=sys.stderr, flush=True)
        rc = 1
    finally:
        dep.stop()
    return rc


def _cmd_drain(args) -> int:
    from pdserve.client import Client

    def go():
        r = Client(args.address).drain(args.engine, args.deadline)
        how = (f"the deadline passed: {r['aborted']} request(s) aborted ('engine drained: "
               "deadline passed')" if r["deadline_passed"] else "every request finished")
        print(f"pdserve: {r['engine']} drained and stopped in {r['seconds']:.1f} s: "
              f"{r['requests_at_start']} request(s) live at the start, {how}; "
              f"{r['refused']} new request(s) sent elsewhere; {r['used_pages']} pages held at "
              "the stop")
        return 0
    return _client_errors(go)


def _client_errors(fn):
    import grpc

    try:
        return fn()
    except grpc.RpcError as e:
        print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


def _cmd_plan(args) -> int:
    from pdserve.cluster.plan_report import command

    return command(args)


def _cmd_stats(args) -> int:
    from pdserve.client import Client

    def go():
        rows = Client(args.address).stats()
        print(f"{'engine':<20} {'role':<8} {'used':>6} {'pinned':>6} {'total':>6} "
              f"{'running':>7} {'waiting':>7} {'finished':>8}")
        for r in rows:
            print(f"{r['name']:<20} {r['role']:<8} {r['used_pages']:>6} {r['pinned_pages']:>6} "
                  f"{r['total_pages']:>6} {r['running']:>7} {r['waiting']:>7} {r['finished']:>8}")
        for r in rows:
            groups = r["cache_groups"]
            if len(groups) > 1:
                print(f"  {r['name']} holds {r['kv_capacity_tokens']:,} tokens: " + "; ".join(
                    (f"window {g['window']}" if g["window"] else "full history") +
                    f" {g['used_pages']}/{g['total_pages']} pages" for g in groups))
        for r in rows:
            for w in r["waiting_requests"]:
                print(f"  {r['name']} waits {w['request_id']}: {w['reason']} ({w['detail']})")
        return 0
    return _client_errors(go)


def _cmd_demo(args) -> int:
    from pdserve.cluster.demo import main as demo_main

    return demo_main(args.config)


def _cmd_generate(args) -> int:
    from pdserve.kernels.sampling import SamplingParams

    if args.address:
        from pdserve.client import Client

        if args.dtype or args.device is not None:
            print("pdserve: error: --dtype and --device apply offline (--config); a running "
                  "deployment uses its own config's model.dtype and devices", file=sys.stderr)
            return 2

        def go():
            c = Client(args.address)
            for text in args.text:
                for chunk in c.generate_stream(text, max_tokens=args.max_tokens,
                                               temperature=args.temperature, top_p=args.top_p,
                                               top_k=args.top_k, seed=args.seed):
                    print(chunk.text, end="", flush=True)
                print()
            return 0
        return _client_errors(go)
    from pdserve.llm import LLM

    if args.config is None:
        print("pdserve: error: generate needs --address HOST:PORT (a running deployment) "
              "or --config FILE (offline, in-process)", file=sys.stderr)
        return 2
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(args.config, device=args.device, dtype=args.dtype)
    for out in llm.generate(args.text, sp, use_tqdm=False):
        print(out.text)
    return 0


def _cmd_bench(args) -> int:
    if args.what == "planner":
        from pdserve.benchmarks.planner import main as bench_main

        return bench_main(sizes=args.sizes, rounds=args.rounds)
    if args.what == "llm":
        from pdserve.benchmarks.llm import main as llm_main

        kw = {k: v for k, v in (("sizes", args.models), ("dtypes", args.dtype),
                                ("workloads", args.workload), ("batches", args.batches),
                                ("trace", args.trace), ("scale", args.scale)) if v}
        return llm_main(**kw, device=args.device)
    if args.what == "tokens":
        from pdserve.benchmarks.tokens import main as tokens_main

        return tokens_main()
    if args.what == "transfer":
        from pdserve.benchmarks.transfer import main as transfer_main

        return transfer_main(device=args.device)
    if args.what == "autoscale":
        from pdserve.benchmarks.autoscale import main as autoscale_main

        return autoscale_main(args.seconds, args.concurrency)
    if args.what == "soak":
        from pdserve.benchmarks.soak import main as soak_main

        return soak_main(args.seconds, args.concurrency, args.seed)
    if args.what == "serve":
        from pdserve.benchmarks.serve import main as serve_main

        if not args.address and not args.config and not args.http_address:
            print("pdserve: error: bench serve needs --address HOST:PORT or --config FILE "
                  "(repeat --config to compare deployments)", file=sys.stderr)
            return 2
        return serve_main(args.address, args.config or [], args.requests, args.prompt_len,
                          args.max_tokens, args.concurrency, args.rate, args.trace, args.limit,
                          args.max_prompt, args.out, apis=args.api,
                          http_address=args.http_address, repeats=args.repeats,
                          offline=args.offline)
    if args.what == "sim-accuracy":
        from pdserve.benchmarks.sim_accuracy import main as accuracy_main

        if not (args.config or args.replay) or not args.profile:
            print("pdserve: error: bench sim-accuracy needs --config (repeatable) or --replay, "
                  "and --profile (from pdserve calibrate)", file=sys.stderr)
            return 2
        return accuracy_main(args.config or [], args.profile, args.requests, args.prompt_len,
                             args.max_tokens, args.fractions, args.repeats, args.saturation,
                             args.out, n_alone=args.alone, quiet=args.quiet,
                             replay=args.replay)
    if args.what == "cache-groups":
        from pdserve.benchmarks.cache_groups import main as groups_main

        return groups_main(args.trace, args.limit)
    if not args.config or not args.trace:
        print(f"pdserve: error: bench {args.what} needs --config and --trace", file=sys.stderr)
        return 2
    if args.what == "disagg":
        from pdserve.benchmarks.disagg import main as disagg_main

        return disagg_main(args.config[0], args.trace, args.limit, args.rates, args.ttft_slo,
                           args.tpot_slo, args.out, args.plot)
    from pdserve.benchmarks.retraction import main as bench_main

    return bench_main(args.config[0], args.trace, limit=args.limit)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    sim = sub.add_parser("sim", help="simulate a cluster on a request trace (virtual time)")
    sim.add_argument("--config", required=True, help="config YAML")
    sim.add_argument("--trace", required=True, help="trace JSONL (ours or Mooncake) or Azure CSV")
    sim.add_argument("--out", required=True, help="where to write the result JSON")
    sim.add_argument("--plans", help="also write one JSON line per engine round here")
    sim.add_argument("--limit", type=int, help="only the first N requests of the trace")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.add_argument("--faults", help="YAML list of faults to inject (see docs/configuration.md)")
    sim.add_argument("--strict", action="store_true",
                     help="admit every request strictly (its whole generation reserved)")
    sim.set_defaults(func=_cmd_sim)

    cal = sub.add_parser("calibrate", help="time the config's real engine over a grid of "
                                           "rounds and fit a cost profile for `pdserve sim`")
    cal.add_argument("--config", required=True, help="config YAML (its model and engine)")
    cal.add_argument("--out", required=True, help="where to write the profile YAML")
    cal.add_argument("--device", help="cpu, cuda or cuda:N (default: the config's model.device)")
    cal.add_argument("--threads", type=_positive,
                     help="torch intra-op threads (default: 1 on CPU, as a Ray engine runs)")
    cal.add_argument("--chunks", type=_positive, nargs="+",
                     help="prefill chunk sizes (default: page_size x 4^k up to "
                          "engine.max_scheduled_tokens)")
    cal.add_argument("--batches", type=_positive, nargs="+",
                     help="decode batch sizes (default: 4^k up to engine.max_batch_size, 64 "
                          "at most)")
    cal.add_argument("--contexts", type=_positive, nargs="+",
                     help="decode context lengths (default: 64 256 1024)")
    cal.add_argument("--decode-rounds", type=_positive, default=4,
                     help="pure decode rounds timed per batch and context (4)")
    cal.add_argument("--seed", type=int, default=0, help="the prompts' random tokens")
    cal.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                     help="time rounds by wall clock (default), or by the thread's CPU time "
                          "(CPU, one thread: leaves out time other processes held the core)")
    cal.add_argument("--copies", type=_positive, default=1,
                     help="run the same grid in this many processes at once and time one: "
                          "a host whose engines share it (default 1: the engine alone)")
    cal.add_argument("--as-load", action="store_true", help=argparse.SUPPRESS)
    cal.add_argument("--rounds", help="also write every timed round (features, seconds) here "
                                      "as JSON lines")
    cal.set_defaults(func=_cmd_calibrate)

    up = sub.add_parser("up", help="start a deployment (local Ray cluster, or join one) and serve")
    up.add_argument("--config", default=str(DEFAULT_CONFIG),
                    help="config YAML (default: deploy/local-pd.yaml, SmolLM2 on 1P+1D)")
    up.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    up.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    up.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    up.add_argument("--http-port", type=int, help="serve the OpenAI-compatible HTTP API here "
                                                   "too (e.g. 8000)")
    up.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (HTTP) or that "
                                      "metadata (gRPC); default $PDSERVE_API_KEY")
    up.add_argument("--tls-cert", help="serve TLS on both ports with this PEM certificate")
    up.add_argument("--tls-key", help="... and this PEM private key")
    up.add_argument("--device", choices=["cpu", "cuda"],
                    help="where engines run (default: the config's model.device; auto is cpu)")
    up.add_argument("--gpus-per-engine", type=float,
                    help="Ray GPUs each engine takes (default 1 on cuda, 0 on cpu; 0 on cuda "
                         "is refused: every engine would share cuda:0)")
    up.add_argument("--drain-deadline", type=float, default=60.0,
                    help="on SIGTERM or Ctrl-C, seconds the engines get to finish their "
                         "requests before what is left is aborted (60)")
    up.set_defaults(func=_cmd_up)

    drain = sub.add_parser("drain", help="drain one engine: it takes no new request, "
                                         "finishes what it holds, then stops")
    drain.add_argument("engine", help="the engine, as ServerInfo names it (decode-0 or "
                                      "pdserve:decode-0)")
    drain.add_argument("--address", required=True, help="the router, HOST:PORT")
    drain.add_argument("--deadline", type=float,
                       help="seconds to wait before aborting what is left (default 60)")
    drain.set_defaults(func=_cmd_drain)

    stats = sub.add_parser("stats", help="per-engine pages and requests of a deployment")
    stats.add_argument("--address", required=True, help="the router, HOST:PORT")
    stats.set_defaults(func=_cmd_stats)

    plan = sub.add_parser("plan", help="search P:D splits and chunk budgets by simulation for "
                                       "the most goodput per GPU within a latency SLO")
    plan.add_argument("--config", required=True, help="base config YAML (its simulate: section "
                                                      "and engine settings)")
    plan.add_argument("--trace", required=True,
                      help="trace JSONL (ours or Mooncake) or Azure CSV, replayed open loop")
    plan.add_argument("--ttft", type=float, required=True, help="time-to-first-token SLO, s")
    plan.add_argument("--tpot", type=float, required=True, help="time-per-output-token SLO, s")
    plan.add_argument("--gpus", type=int, required=True, help="engines to plan, one GPU each")
    plan.add_argument("--attainment", type=float, default=0.9,
                      help="fraction of requests that must meet both SLOs (0.9)")
    plan.add_argument("--limit", type=int, help="only the first N requests of the trace")
    plan.add_argument("--chunks", type=int, nargs="+",
                      help="engine.max_scheduled_tokens values to try (2048 8192)")
    plan.add_argument("--tolerance", type=float,
                      help="stop a bisection when its failing rate is within this fraction "
                           "of its passing rate (0.1)")
    plan.add_argument("--address", help="run the simulations on this Ray cluster (default: a "
                                        "local Ray on every core)")
    plan.add_argument("--cpus", type=_positive, help="simulations at once: a local Ray's "
                                                     "CPUs (default: every core; with "
                                                     "--address, the cluster's CPUs)")
    plan.add_argument("--in-process", action="store_true",
                      help="run the simulations here, one at a time, without Ray")
    plan.add_argument("--no-progress", action="store_true", help="no progress bar")
    plan.add_argument("--out", required=True, help="folder for plan.yaml, plan.json, plan.png")
    plan.set_defaults(func=_cmd_plan)

    demo = sub.add_parser("demo", help="a local 1P+1D cluster on SmolLM2-135M-Instruct, a "
                                       "few concurrent questions, streamed answers, stats")
    demo.add_argument("--config", default=None, help="config YAML (default: deploy/local-pd.yaml)")
    demo.set_defaults(func=_cmd_demo)

    gen = sub.add_parser("generate", help="generate text: from a running deployment "
                                          "(--address) or offline in-process (--config)")
    gen.add_argument("--address", help="the router of a running deployment, HOST:PORT")
    gen.add_argument("--config", help="config YAML (model and engine), offline")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--device", help="offline: cpu, cuda or cuda:N (default: the config's "
                                      "model.device; auto is cpu)")
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                     help="offline: overrides the config's model.dtype")
    gen.add_argument("text", nargs="+", help="one or more prompts")
    gen.set_defaults(func=_cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks that print a table")
    bench.add_argument("what", choices=["planner", "retraction", "disagg", "llm", "transfer",
                                        "serve", "soak", "tokens", "cache-groups",
                                        "sim-accuracy", "autoscale"],
                       help="planner: plan-build cost per round; retraction: a tight pool "
                            "with the host cache off and on, and every request strict; "
                            "disagg: fused against P/D splits across request rates; "
                            "llm: pdserve.LLM against Hugging Face generate; "
                            "transfer: KV handoff over NIXL against raw NIXL and memcpy; "
                            "serve: load a deployment through the client; "
                            "soak: faults, aborts and a killed engine under load; "
                            "tokens: what a generated token costs on its way out of an engine; "
                            "cache-groups: Gemma 3 27B's sliding-window groups against every "
                            "layer full (per-request bytes, concurrency, a simulated trace); "
                            "sim-accuracy: the simulator with a calibrated profile against "
                            "the real deployment at concurrency 1 and fractions of saturation; "
                            "autoscale: a sine load against 1P+1D fixed and autoscaled")
    bench.add_argument("--sizes", type=_positive, nargs="+", default=[64, 256, 1024, 4096],
                       help="planner: decoding requests per round (64 256 1024 4096)")
    bench.add_argument("--rounds", type=_positive, default=200,
                       help="planner: rounds timed per size (200)")
    bench.add_argument("--config", action="append",
                       help="config YAML (serve: start this deployment; repeat to compare)")
    bench.add_argument("--trace", help="the trace (serve: replayed with lengths capped; llm: "
                                       "the lengths of its trace workload, default the Azure "
                                       "conversation trace in ../shared/data/traces; "
                                       "cache-groups: default the Mooncake one there)")
    bench.add_argument("--address", help="serve: a running deployment's router")
    bench.add_argument("--http-address", help="serve: a running deployment's HTTP API, "
                                              "e.g. http://127.0.0.1:8000")
    bench.add_argument("--api", nargs="+", choices=["grpc", "http"], default=["grpc"],
                       help="serve: the client APIs to load (both: side by side, interleaved)")
    bench.add_argument("--offline", action="store_true",
                       help="serve: also run the same requests through pdserve.LLM in-process "
                            "(each --config), the engine's own rate")
    bench.add_argument("--repeats", type=_positive, default=1,
                       help="serve: runs of each API; the median is reported with the spread")
    bench.add_argument("--requests", type=int, default=64, help="serve: how many")
    bench.add_argument("--prompt-len", type=int, default=128, help="serve: synthetic prompts")
    bench.add_argument("--max-tokens", type=int, default=64, help="serve: per request")
    bench.add_argument("--max-prompt", type=int, default=1024, help="serve: cap replayed prompts")
    bench.add_argument("--concurrency", type=int, default=16, help="serve: requests in flight")
    bench.add_argument("--rate", type=float, help="serve: Poisson arrivals a second")
    bench.add_argument("--seconds", type=float, default=60.0, help="soak: how long")
    bench.add_argument("--seed", type=int, default=0, help="soak: reproduces a run")
    bench.add_argument("--models", nargs="+", choices=["tiny", "llama-110m"],
                       help="llm: model shapes, random weights built on the spot, nothing "
                            "downloaded (default both)")
    bench.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"],
                       help="llm: dtypes, each run by both sides (default both)")
    bench.add_argument("--device", default="cpu",
                       help="llm, transfer: cpu or cuda (transfer: GPU pools, NIXL VRAM)")
    bench.add_argument("--workload", nargs="+", choices=["uniform", "trace"],
                       help="llm: uniform lengths and/or the trace's (default both)")
    bench.add_argument("--batches", type=_positive, nargs="+",
                       help="llm: batch sizes (default 1 8 32)")
    bench.add_argument("--scale", type=_positive,
                       help="llm: divide the trace's lengths by this (default 8)")
    bench.add_argument("--limit", type=int, help="only the first N requests of the trace "
                                                 "(cache-groups: default 300)")
    bench.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0],
                       help="disagg: arrival-rate multipliers of the trace's own rate")
    bench.add_argument("--ttft-slo", type=float, default=2.0, help="disagg: seconds")
    bench.add_argument("--tpot-slo", type=float, default=0.1, help="disagg: seconds")
    bench.add_argument("--out", help="disagg, serve: save the results as JSON here")
    bench.add_argument("--plot", help="disagg: draw goodput against rate into this PNG")
    bench.add_argument("--profile", help="sim-accuracy: the cost profile the simulator uses")
    bench.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.9, 1.1],
                       help="sim-accuracy: Poisson rates as fractions of the measured "
                            "saturation (0.5 0.9 1.1)")
    bench.add_argument("--saturation", type=float,
                       help="sim-accuracy: saturation in req/s (default: measured closed-loop "
                            "at concurrency 16)")
    bench.add_argument("--alone", type=_positive, default=8,
                       help="sim-accuracy: requests run at concurrency 1 (8)")
    bench.add_argument("--quiet", type=float,
                       help="sim-accuracy: before each real run, wait until processes outside "
                            "the benchmark use under this many cores")
    bench.add_argument("--replay", help="sim-accuracy: simulate the real runs of this --out "
                                        "JSON again with --profile; start nothing")
    bench.set_defaults(func=_cmd_bench)
    return ap


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def main(argv=None) -> int:
    from pdserve.cluster.trace import TraceError
    from pdserve.scheduler.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, TraceError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
