"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from pdserve.benchmarks.args import client_key, client_key_argument, positive

DEFAULT_CONFIG = "deploy/local-pd.yaml"    # shipped: found in the package (config.shipped)
# `pdserve bench NAME`: each module defines its options (`add_arguments`) and
# runs on them (`run`); importing one loads no torch or Ray
BENCHMARKS = [
    ("planner", "pdserve.benchmarks.planner", "plan-build cost per round"),
    ("retraction", "pdserve.benchmarks.retraction",
     "a tight pool with the host cache off and on, and every request strict"),
    ("disagg", "pdserve.benchmarks.disagg", "fused against P/D splits across request rates"),
    ("llm", "pdserve.benchmarks.llm", "pdserve.LLM against Hugging Face generate"),
    ("transfer", "pdserve.benchmarks.transfer",
     "KV handoff over NIXL against raw NIXL and memcpy"),
    ("serve", "pdserve.benchmarks.serve", "load a deployment through the client"),
    ("soak", "pdserve.benchmarks.soak", "faults, aborts and a killed engine under load"),
    ("tokens", "pdserve.benchmarks.tokens",
     "what a generated token costs on its way out of an engine"),
    ("cache-groups", "pdserve.benchmarks.cache_groups",
     "Gemma 3 27B's sliding-window groups against every layer full (per-request bytes, "
     "concurrency, a simulated trace)"),
    ("state-capacity", "pdserve.benchmarks.state_capacity",
     "Qwen3-Next-80B's snapshot-state groups against vLLM-style pages and every layer "
     "attention (requests of a long prompt one node's pool holds)"),
    ("state-reuse", "pdserve.benchmarks.state_reuse",
     "prefix hits on Qwen3-Next-80B with state checkpoints on and off, fused and P/D "
     "(the Mooncake conversation trace, simulated)"),
    ("sim-accuracy", "pdserve.benchmarks.sim_accuracy",
     "the simulator with a calibrated profile against the real deployment at concurrency 1 "
     "and fractions of saturation, also at the engines' own speed in each run"),
    ("autoscale", "pdserve.benchmarks.autoscale",
     "a sine load against 1P+1D fixed and autoscaled"),
    ("sampling", "pdserve.benchmarks.sampling",
     "a round's logits to tokens on a real model's vocabulary, against the sampler before"),
    ("loop", "pdserve.benchmarks.loop",
     "where a fused engine's round goes (planner, forward, sampling), and what overlapping "
     "the planner with the forward could save"),
]


def _cmd_sim(args) -> int:
    from pdserve.config import load_config
    from pdserve.sim.fault_plan import load_faults
    from pdserve.sim.simulation import Simulation, build_engines, format_summary
    from pdserve.sim.trace import read_trace

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
    from pdserve.sim.calibrate import main as calibrate_main

    if args.served:
        given = [f"--{k}" for k in ("threads", "device") if getattr(args, k)]
        given += ["--copies"] * (args.copies > 1) + ["--clock cpu"] * (args.clock == "cpu")
        if given:
            print(f"pdserve calibrate: --served scales the sweep to the deployment's own "
                  f"engines, which take their device and threads from the config; drop "
                  f"{', '.join(given)}", file=sys.stderr)
            return 2
    return calibrate_main(args.config, args.out, args.device, args.threads, args.chunks,
                          args.batches, args.contexts, args.decode_rounds, args.seed,
                          args.rounds, args.clock, args.copies, args.as_load, args.served)


def _cmd_up(args) -> int:
    import signal
    import threading

    from pdserve.config import engine_gpus, load_config

    cfg = load_config(args.config)
    device = cfg.model.device_for(args.device)
    gpus = engine_gpus(device, args.gpus_per_engine)    # refused before Ray starts
    from pdserve.kernels.loader import model_config_for

    # a preset unknown or not installed, a path that holds no checkpoint, a port
    # in use: refused here, not in each engine's actor or after Ray has started
    # (the router reads the model's tokenizer on this machine in any case)
    model_config_for(cfg.model.path, cfg.model.preset)
    for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
        if port and not _port_free(args.host, port):
            print(f"pdserve: error: port {port} ({flag}) on {args.host} is in use; stop what "
                  "holds it or pick another", file=sys.stderr)
            return 2
    if cfg.model.preset == "tiny" and cfg.model.path is None and not cfg.model_given:
        print(f"pdserve: warning: {args.config or 'the config'} names no model: serving the "
              "tiny preset (random weights, its text is noise); set model: {preset: "
              "smollm2-135m} or model: {path: ...}", file=sys.stderr, flush=True)
    from pdserve.cluster.deploy import Deployment
    from pdserve.router.router import Security

    if bool(args.tls_cert) != bool(args.tls_key):
        print("pdserve: error: --tls-cert and --tls-key go together; give both or neither",
              file=sys.stderr)
        return 2
    for path in (args.tls_cert, args.tls_key):
        if path and not Path(path).is_file():
            print(f"pdserve: error: TLS file {path!r} does not exist", file=sys.stderr)
            return 2
    key = client_key(args)
    dep = Deployment(cfg, address=args.address, device=device, gpus_per_engine=gpus,
                     security=Security(key, args.tls_cert, args.tls_key))
    addr = dep.start(host=args.host, port=args.port, http_port=args.http_port)
    http = f", OpenAI HTTP on {dep.http_address}" if dep.http_address else ""
    for info in dep.infos:
        print(f"pdserve: {info['engine']} ({info['role']}) at {info['address']}: "
              f"{info['dtype']}, {info['attention']} attention, KV cache holds "
              f"{info['kv_capacity_tokens']:,} tokens", flush=True)
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
        r = Client(args.address, api_key=client_key(args)).drain(args.engine, args.deadline)
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
    from pdserve.sim.plan_report import command

    return command(args)


def _cmd_stats(args) -> int:
    from pdserve.client import Client

    def go():
        rows = Client(args.address, api_key=client_key(args)).stats()
        print(f"{'engine':<20} {'role':<8} {'used':>6} {'pinned':>6} {'total':>6} "
              f"{'running':>7} {'waiting':>7} {'transfers':>9} {'finished':>8}")
        for r in rows:
            print(f"{r['name']:<20} {r['role']:<8} {r['used_pages']:>6} {r['pinned_pages']:>6} "
                  f"{r['total_pages']:>6} {r['running']:>7} {r['waiting']:>7} "
                  f"{r['transfers']:>9} {r['finished']:>8}")
        for r in rows:
            groups = r["cache_groups"]
            if len(groups) > 1:
                print(f"  {r['name']} holds {r['kv_capacity_tokens']:,} tokens: " + "; ".join(
                    (f"window {g['window']}" if g["window"] else "full history") +
                    f" {g['used_pages']}/{g['total_pages']} pages" for g in groups))
        for r in rows:
            if r["rounds"]:
                print(f"  {r['name']} ran {r['rounds']:,} rounds in {r['round_seconds']:.1f} s "
                      f"({r['round_cpu_seconds'] / r['round_seconds']:.0%} of it on a core), "
                      f"{r['round_tokens'] / r['rounds']:.1f} tokens a round")
        for r in rows:
            for w in r["waiting_requests"]:
                print(f"  {r['name']} waits {w['request_id']}: {w['reason']} ({w['detail']})")
        return 0
    return _client_errors(go)


def _cmd_demo(args) -> int:
    from pdserve.cli.demo import main as demo_main

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
            c = Client(args.address, api_key=client_key(args))
            for i, text in enumerate(args.text):
                if len(args.text) > 1:
                    print(f"[{i}] {text!r} ->", end=" ", flush=True)
                for chunk in c.generate_stream(text, max_tokens=args.max_tokens,
                                               temperature=args.temperature, top_p=args.top_p,
                                               top_k=args.top_k, seed=args.seed,
                                               **_penalties(args)):
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
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, **_penalties(args))
    llm = LLM(args.config, device=args.device, dtype=args.dtype)
    for i, (text, out) in enumerate(zip(args.text, llm.generate(args.text, sp, use_tqdm=False))):
        print(f"[{i}] {text!r} -> {out.text}" if len(args.text) > 1 else out.text)
    return 0


def _penalties(args) -> dict:
    return {"presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty,
            "repetition_penalty": args.repetition_penalty, "min_p": args.min_p}


def _port_free(host: str, port: int) -> bool:
    """False only when something holds the port (as the servers bind it: with
    SO_REUSEADDR, so a port a stopped deployment left in TIME_WAIT is free);
    any other trouble with the address is the server's to report."""
    import errno
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return True
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            return e.errno != errno.EADDRINUSE
    return True


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
    cal.add_argument("--threads", type=positive,
                     help="torch intra-op threads (default: 1 on CPU, as a Ray engine runs)")
    cal.add_argument("--chunks", type=positive, nargs="+",
                     help="prefill chunk sizes (default: page_size x 4^k up to "
                          "engine.max_scheduled_tokens)")
    cal.add_argument("--batches", type=positive, nargs="+",
                     help="decode batch sizes (default: 4^k up to engine.max_batch_size, 64 "
                          "at most)")
    cal.add_argument("--contexts", type=positive, nargs="+",
                     help="decode context lengths (default: 64 256 1024)")
    cal.add_argument("--decode-rounds", type=positive, default=4,
                     help="pure decode rounds timed per batch and context (4)")
    cal.add_argument("--seed", type=int, default=0, help="the prompts' random tokens")
    cal.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                     help="time rounds by wall clock (default), or by the thread's CPU time "
                          "(CPU, one thread: leaves out time other processes held the core)")
    cal.add_argument("--copies", type=positive, default=1,
                     help="after the fit, time the sweep again beside this many - 1 processes "
                          "sweeping the same grid, for the profile's neighbour_slowdown "
                          "(engines sharing a host's cores; default 1: alone)")
    cal.add_argument("--served", action="store_true",
                     help="after the sweep, start the config's deployment, serve a generated "
                          "load through its router, and scale the profile to the rounds its "
                          "engines time (and fit neighbour_slowdown on them)")
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
    client_key_argument(drain)
    drain.set_defaults(func=_cmd_drain)

    stats = sub.add_parser("stats", help="per-engine pages and requests of a deployment")
    stats.add_argument("--address", required=True, help="the router, HOST:PORT")
    client_key_argument(stats)
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
    plan.add_argument("--cpus", type=positive, help="simulations at once: a local Ray's "
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
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--device", help="offline: cpu, cuda or cuda:N (default: the config's "
                                      "model.device; auto is cpu)")
    gen.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                     help="offline: overrides the config's model.dtype")
    client_key_argument(gen)
    gen.add_argument("text", nargs="+", help="one or more prompts")
    gen.set_defaults(func=_cmd_generate)

    about = "benchmarks that print a table; each has its own options: pdserve bench NAME --help"
    bench = sub.add_parser("bench", help=about, description=about)
    bench_sub = bench.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    for name, module, text in BENCHMARKS:
        mod = importlib.import_module(module)
        p = bench_sub.add_parser(name, help=text, description=text)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)
    return ap


def main(argv=None) -> int:
    from pdserve.sim.trace import TraceError
    from pdserve.scheduler.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, TraceError, ValueError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
