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
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    dep.stop()
    return 0


def _client_errors(fn):
    import grpc

    try:
        return fn()
    except grpc.RpcError as e:
        print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


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
    up.set_defaults(func=_cmd_up)

    stats = sub.add_parser("stats", help="per-engine pages and requests of a deployment")
    stats.add_argument("--address", required=True, help="the router, HOST:PORT")
    stats.set_defaults(func=_cmd_stats)

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
                                        "serve", "soak", "tokens", "cache-groups"],
                       help="planner: plan-build cost per round; retraction: a tight pool "
                            "with the host cache off and on, and every request strict; "
                            "disagg: fused against P/D splits across request rates; "
                            "llm: pdserve.LLM against Hugging Face generate; "
                            "transfer: KV handoff over NIXL against raw NIXL and memcpy; "
                            "serve: load a deployment through the client; "
                            "soak: faults, aborts and a killed engine under load; "
                            "tokens: what a generated token costs on its way out of an engine; "
                            "cache-groups: Gemma 3 27B's sliding-window groups against every "
                            "layer full (per-request bytes, concurrency, a simulated trace)")
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
