"""`pdserve up`: start a deployment (a local Ray, or join one) and serve until
SIGTERM or Ctrl-C, then drain every engine and stop. What a user can get
wrong (the model, a port, the TLS files) is refused before Ray starts."""

from __future__ import annotations

import sys
from pathlib import Path

from pdserve.benchmarks.common.options import client_key
from pdserve.benchmarks.common.options import add_model_arguments
from pdserve.config import UP_CONFIG


def add_arguments(p) -> None:
    p.add_argument("--config", default=UP_CONFIG,
                   help="config YAML (default: deploy/local-pd.yaml, SmolLM2 on 1P+1D); the "
                        "flags below replace what it says of the same setting")
    add_model_arguments(p, positional=True)
    p.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    p.add_argument("--host", default="127.0.0.1", help="the router's bind address")
    p.add_argument("--port", type=int, default=50051, help="the router's gRPC port")
    p.add_argument("--http-port", type=int, help="serve the OpenAI-compatible HTTP API here "
                                                 "too (e.g. 8000)")
    # not client_key_argument: here the key is the one the deployment requires
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (HTTP) or that "
                                     "metadata (gRPC); default $PDSERVE_API_KEY")
    p.add_argument("--tls-cert", help="serve TLS on both ports with this PEM certificate")
    p.add_argument("--tls-key", help="... and this PEM private key")
    p.add_argument("--insecure-control-plane", action="store_true",
                   help="plaintext between the router and the engines (default: mutual TLS "
                        "with a CA made at start); anyone who reaches an engine's port can "
                        "then drive it. Also control_plane.insecure in the config")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="where engines run (model.device; default: the config's, auto is cpu)")
    p.add_argument("--gpus-per-engine", type=float,
                   help="Ray GPUs each engine takes (default 1 on cuda, 0 on cpu; 0 on cuda "
                        "is refused: every engine would share cuda:0)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                   help="serve these PEFT LoRA adapters beside the base model, each selected "
                        "by its NAME in a request's model (adds to the config's lora.adapters); "
                        "vLLM's JSON form '{\"name\": N, \"path\": P, \"pinned\": true}' "
                        "also pins one in its device slot")
    p.add_argument("--max-loras", type=int,
                   help="LoRA adapters on the device at once (default: the config's "
                        "lora.max_loras, 1)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help="speculative decoding, as vLLM spells it: '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' "
                        "(replaces the config's speculative settings; docs/speculative.md)")
    p.add_argument("--drain-deadline", type=float, default=60.0,
                   help="on SIGTERM or Ctrl-C, seconds the engines get to finish their "
                        "requests before what is left is aborted (60)")


def run(args) -> int:
    from pdserve.benchmarks.common.options import flags_from
    from pdserve.config import engine_gpus, load_with_flags
    from pdserve.scheduler.config import ConfigError

    cfg, merged = load_with_flags(args.config, flags_from(args))
    print_config(merged)
    device = cfg.model.device_for()
    gpus = engine_gpus(device, args.gpus_per_engine)    # refused before Ray starts
    from pdserve.kernels.models.loader import model_config_for

    # a preset unknown or not installed, a path that holds no checkpoint, a port
    # in use: refused here, not in each engine's actor or after Ray has started
    # (the router reads the model's tokenizer on this machine in any case)
    mcfg = model_config_for(cfg.model.path, cfg.model.preset)
    from pdserve.kernels.tensor_parallel import TpError, check_roles

    try:                    # a family not sharded, a size that does not divide the heads
        check_roles(mcfg, cfg)
    except TpError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    spec = cfg.engine.speculative
    if spec is not None and spec.draft_model is not None:
        from pdserve.kernels.models.model_config import ModelError
        from pdserve.engine.spec.draft import check_draft_section
        try:                # a draft of another vocabulary or context, one that keeps state
            check_draft_section(spec.draft_model, mcfg, cfg.engine)
        except (ConfigError, ModelError) as e:
            print(f"pdserve: error: {e}", file=sys.stderr)
            return 2
    if cfg.lora.enabled:
        from pdserve.kernels.lora.adapter import AdapterError, load_adapter
        try:
            for _, path in cfg.lora.adapters:
                load_adapter(path, mcfg, cfg.lora.max_lora_rank)
        except AdapterError as e:
            print(f"pdserve: error: {e}", file=sys.stderr)
            return 2
    if cfg.engine.disk_cache is not None:
        from pdserve.engine.disk.model_match import check_model_served
        from pdserve.transfer.disk.files import check_directory
        from pdserve.transfer.disk.store import DiskStoreError

        try:
            check_model_served(cfg.engine.disk_cache, mcfg, cfg.engine.state_block,
                               cfg.engine.sliding_replay, cfg.engine.state_checkpoints)
            check_directory(cfg.engine.disk_cache.path)
        except (ConfigError, DiskStoreError) as e:
            print(f"pdserve: error: {e}", file=sys.stderr)
            return 2
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
    cp = cfg.control_plane      # bring-your-own certificates: checked before Ray starts
    for path in (cp.ca_cert, cp.ca_key, cp.cert, cp.key):
        if path and not Path(path).is_file():
            print(f"pdserve: error: control_plane certificate file {path!r} does not exist",
                  file=sys.stderr)
            return 2
    if cfg.control_plane.insecure:
        print("pdserve: warning: the control plane is insecure: anyone who reaches an "
              "engine's port can submit, abort or drain its work, or join as a peer that "
              "receives KV pages", file=sys.stderr, flush=True)
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
    return _serve_until_stopped(dep, args.drain_deadline)


def _serve_until_stopped(dep, drain_deadline: float) -> int:
    """Wait for SIGTERM or Ctrl-C, drain every engine, stop. A second signal
    stops without waiting for the drain."""
    import signal
    import threading

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
        print(f"pdserve: draining every engine (at most {drain_deadline:g} s, then what "
              "is left is aborted); Ctrl-C again stops at once", flush=True)
        for name, how in dep.drain(drain_deadline).items():
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



def print_config(merged: dict) -> None:
    """The config this deployment runs, the flags over the file, as one YAML
    document: saved as a file, `--config` starts the same deployment."""
    import yaml

    print("pdserve: the config this runs (save it and pass it to --config to run it again):",
          flush=True)
    print(yaml.safe_dump(merged, sort_keys=False, explicit_start=True, explicit_end=True),
          end="", flush=True)
