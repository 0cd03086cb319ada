"""Engines as Ray actors: `ray.remote` is applied here and nowhere else.

`build_engine_server` wires an engine from a deployment's config (the model,
its executor and planner, the KV transport and its fault rules); the engine
itself (engine/) never reads the config.

Each engine is named `pdserve:<role>-<index>` in namespace `pdserve` and is
restarted by Ray when its process dies (a restart is a new incarnation; the
router notices and introduces it to its peers again). An incarnation is a
number that only grows (`engine_incarnation`): when the engine's creator
made the actor, then how many times Ray restarted it, never the clock of
the node it restarts on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import ray
from ray._private import state as ray_state

from pdserve.cluster.autoscaler import Autoscaler
from pdserve.cluster.cpu_threads import share_kernel_cores, thread_env
from pdserve.config import ServeConfig, engine_for_model, role_engine
from pdserve.proto.control_tls import ControlPlane, ControlTls
from pdserve.router.engines.membership import EngineGone
from pdserve.engine.lora.adapters import EngineAdapters
from pdserve.engine.server import EngineServer
from pdserve.engine.outputs import Outputs
from pdserve.engine.peer.protocol import PeerTimeouts
from pdserve.engine.executor.torch_executor import TorchExecutor
from pdserve.engine.tp.leader import load_engine_model
from pdserve.scheduler.capacity import capacity_line, capacity_report
from pdserve.scheduler.round.grammar import Role
from pdserve.scheduler.planner import Planner
from pdserve.transfer import FaultInjector, Incarnation

NAMESPACE = "pdserve"
log = logging.getLogger("pdserve.engine")


def build_engine_server(cfg: ServeConfig, role: str, index: int, host: str = "127.0.0.1",
                        device: str = "cpu", transfer_timeout_s: float | None = None,
                        lease_s: float | None = None, heartbeat_s: float | None = None,
                        faults: list[dict] | None = None, fault_seed: int = 0,
                        serve: bool = True, control_tls: ControlTls | None = None,
                        on_stuck: Callable[[str], None] | None = None,
                        incarnation: int | None = None) -> EngineServer:
    """Engine `<role>-<index>` of `cfg`: its model loaded on `device`, and
    (P and D) a NIXL transport with `faults` (transfer/faults.py). With
    `serve`, started: its gRPC port open on `host` (mutual TLS with
    `control_tls`; None: plaintext) and its loop running.
    `transfer_timeout_s`, `lease_s`, `heartbeat_s`: over the config's
    `transfer:` section (engine options, as tests pass them); the result
    is checked again, so an override cannot break what the config kept.
    `on_stuck(why)`: what the engine does once its loop or output thread
    has been stuck past engine.stuck_loop_restart_s (the actor's: exit for
    Ray to restart it; None: log it, as an engine in a test's process).
    `incarnation`: the actor's (`engine_incarnation`); None: made now, never
    restarted (an engine in a test's or a benchmark's process)."""
    kind, name = Role(role), f"{role}-{index}"
    if incarnation is None:
        incarnation = engine_incarnation(time.time_ns() // 1_000_000, 0)
    base = role_engine(cfg, role)
    # tensor_parallel_size > 1: this process is rank 0; a rank lost exits it (tp_leader.py)
    model, tok = load_engine_model(cfg.model.path, cfg.model.preset, dtype=cfg.model.dtype,
                                   device=device, attention=cfg.model.attention,
                                   tensor_parallel_size=base.tensor_parallel_size,
                                   timeout_s=base.tensor_parallel_timeout_s,
                                   check=base.tensor_parallel_check,
                                   on_lost=lambda e: _engine_lost(name, e),
                                   quantization=cfg.model.quantization,
                                   expert_parallel=cfg.model.expert_parallel)
    engine_cfg = engine_for_model(base, cfg.engine_overrides, model.cfg.max_position)
    adapters = None
    if cfg.lora.enabled:
        # every engine, P and D alike, holds every configured adapter: P's KV
        # must be computed under the adapter D decodes with
        adapters = EngineAdapters(model, name, cfg.lora.adapters, cfg.lora.max_loras,
                                  cfg.lora.max_lora_rank, cfg.model.served_name,
                                  cfg.lora.cpu_loras, cfg.lora.pinned)
    executor = TorchExecutor(model, tok, engine_cfg, detokenize=False, adapters=adapters)
    planner = Planner(engine_cfg, kind, groups=executor.groups,
                      lora_slots=cfg.lora.max_loras if adapters is not None else 0)
    if adapters is not None:
        adapters.bind(planner.lora)
    capacity = capacity_report(engine_cfg, planner.groups, executor.group_bytes())
    log.info("%s: %s", name, capacity_line(capacity))
    if device == "cpu":
        import torch

        shared = share_kernel_cores(base.cpu_threads)
        log.info("%s: %d torch threads (engine.cpu_threads; OMP_NUM_THREADS=%s), pdserve's "
                 "kernels shared among %d", name, torch.get_num_threads(),
                 os.environ.get("OMP_NUM_THREADS", "unset"), shared)
    transport = None
    if kind is not Role.FUSED:
        from pdserve.engine.tp.transfer import register_transfer_pools
        from pdserve.transfer.nixl.transport import NixlTransport

        transport = NixlTransport(Incarnation(name, incarnation),
                                  FaultInjector.from_config(faults or [], fault_seed))
        per_rank = any(role_engine(cfg, r).tensor_parallel_size > 1 for r in ("prefill", "decode"))
        register_transfer_pools(transport, model, executor, engine_cfg.page_size, per_rank)
    server = EngineServer(kind, name, planner, executor,
                          lambda on_stop: Outputs(tok, on_stop, name), transport,
                          incarnation=incarnation, capacity=capacity,
                          timeouts=timeouts_for(cfg, transfer_timeout_s, lease_s, heartbeat_s),
                          control_tls=control_tls, vocab_size=model.cfg.vocab_size,
                          on_stuck=on_stuck)
    if serve:
        server.start(host)
    return server


RESTART_BITS = 20          # restarts an incarnation number counts past its creation


def engine_incarnation(created_ms: int, restarts: int) -> int:
    """An engine's incarnation: when its creator made the actor (ms, the
    creator's clock), then how often Ray restarted it. A restart is always
    larger than what it replaces (the count only grows, whatever the clock
    of the node it lands on says), and an actor made again under the same
    name later is larger too: its creator's clock moved on."""
    if not 0 <= restarts < 1 << RESTART_BITS:
        raise ValueError(f"{restarts} restarts: an incarnation counts at most "
                         f"{(1 << RESTART_BITS) - 1}")
    return (created_ms << RESTART_BITS) | restarts


def _ray_restarts() -> int:
    """How often Ray restarted the actor this runs in (0: its first start)."""
    ctx = ray.get_runtime_context()
    try:                # what the public was_current_actor_reconstructed reads, as a count
        from ray._private.state import actors

        return int(actors(actor_id=ctx.get_actor_id())["NumRestarts"])
    except Exception:
        return int(bool(ctx.was_current_actor_reconstructed))


def _engine_lost(name: str, why: object) -> None:
    """A rank of a tensor-parallel engine is gone, or the engine's loop or
    output thread has been stuck past engine.stuck_loop_restart_s
    (engine/watchdog.py): the engine goes down as one unit. Its process
    exits now (its worker ranks follow, their pipes closed); Ray restarts
    the actor, which starts every rank afresh, and the router resubmits
    what the engine still held as for any engine that dies."""
    log.critical("%s: %s; exiting so that Ray restarts the engine whole", name, why)
    logging.shutdown()
    os._exit(70)


def timeouts_for(cfg: ServeConfig, transfer_timeout_s: float | None = None,
                 lease_s: float | None = None, heartbeat_s: float | None = None) -> PeerTimeouts:
    """The config's P/D timeouts with the engine options given over them."""
    given = {"transfer_s": transfer_timeout_s, "lease_s": lease_s, "heartbeat_s": heartbeat_s}
    return dataclasses.replace(cfg.transfer, **{k: v for k, v in given.items()
                                                if v is not None}).check()


class EngineHost:
    """The actor body: an EngineServer bound to this node's address (the
    one Ray gives the node, never 0.0.0.0 unless `host` says so), its
    control port behind `control_tls` (this engine's leaf; None: plaintext).
    `created_ms`: when its creator made the actor (a restart by Ray passes
    the same value again; the restart count tells the incarnations apart)."""

    def __init__(self, cfg: ServeConfig, role: str, index: int, device: str, options: dict,
                 host: str | None, control_tls: ControlTls | None = None,
                 created_ms: int = 0):
        host = host or ray.util.get_node_ip_address()
        name = f"{role}-{index}"
        self.server = build_engine_server(cfg, role, index, host=host, device=device,
                                          control_tls=control_tls,
                                          on_stuck=lambda why: _engine_lost(name, why),
                                          incarnation=engine_incarnation(created_ms,
                                                                         _ray_restarts()),
                                          **options)
        self.niceness = os.getpriority(os.PRIO_PROCESS, 0)   # Deployment warns if > 0

    def info(self) -> dict:
        # a tensor-parallel engine's worker ranks (what a chaos test kills)
        ranks = [p.pid for p in getattr(self.server.executor.model, "procs", [])]
        import torch

        return {**self.server.info(), "node_id": ray.get_runtime_context().get_node_id(),
                "niceness": self.niceness, "tp_worker_pids": ranks,
                "torch_threads": torch.get_num_threads()}

    def shutdown(self) -> None:
        self.server.shutdown()

    def set_faults(self, rules: list[dict], seed: int = 0) -> None:
        self.server.set_faults(rules, seed)

    def check(self) -> dict:
        return self.server.check()

    def request_state(self, req_id: str) -> str | None:
        return self.server.request_state(req_id)

    def take_rounds(self) -> list:
        return self.server.take_rounds()

    def hold_loop(self, seconds: float) -> None:
        """A test's fault: the loop thread runs a job that sleeps `seconds`
        (a stuck loop; the watchdog reports it, and past
        engine.stuck_loop_restart_s the engine exits for Ray to restart)."""
        self.server.post_job(lambda: time.sleep(seconds))


EngineActor = ray.remote(EngineHost)


class RouterHost:
    """A router replica in a process of its own (router.replicas > 1): the
    same ports as the others (SO_REUSEPORT), the same engines, its own
    streams and its own subscription to each engine."""

    def __init__(self, cfg: ServeConfig, engines: list[tuple], security, host: str, port: int,
                 http_port: int | None):
        from pdserve.router.router import Router
        from pdserve.router.serve import serve
        from pdserve.kernels.models.loader import load_tokenizer, model_config_for

        m = cfg.model
        tok = load_tokenizer(m.path, m.preset)

        def resolve(name: str) -> str:
            return engine_address(name, lambda: ray.get_actor(
                actor_name(*name.rsplit("-", 1)), namespace=NAMESPACE))

        def retire(name: str) -> None:        # drained and stopped: never restarted
            actor = ray.get_actor(actor_name(*name.rsplit("-", 1)), namespace=NAMESPACE)
            ray.kill(actor, no_restart=True)
        model_cfg = model_config_for(m.path, m.preset)
        self.router = Router(cfg, tok, model_cfg.vocab_size, engines, resolve, security, retire,
                             full_history=model_cfg.full_history)
        serve(self.router, host, port, http_port)

    def info(self) -> dict:
        return {"id": self.router.id, "address": self.router.address,
                "http_address": self.router.http_address}

    def stop(self) -> None:
        self.router.stop()


RouterActor = ray.remote(RouterHost)
AutoscalerActor = ray.remote(Autoscaler)


# the states of Ray's actor table in which the process the router knew is gone
ENDED_STATES = ("RESTARTING", "DEAD")


def engine_address(name: str, find: Callable[[], Any]) -> str:
    """The router's resolver: where engine `name` (its Ray actor, from
    `find()`) answers now. Raises EngineGone when Ray reports the actor
    dead or restarting (its process has ended), so its peers can be told
    at once; any other error means not known yet. The state comes from
    the GCS actor table, which Ray reads publicly only through its
    dashboard (`ray.util.state`), which a deployment may run without."""
    try:
        actor = find()
    except ValueError:                        # no actor by that name: gone for good
        raise EngineGone(f"Ray knows no actor for {name}") from None
    entry = ray_state.actors(actor_id=actor._actor_id.hex())
    if entry.get("State") in ENDED_STATES:
        raise EngineGone(f"Ray reports {name}'s actor {entry['State']}")
    return ray.get(actor.info.remote(), timeout=5)["address"]


def actor_name(role: str, index: int | str) -> str:
    return f"pdserve:{role}-{index}"


# glibc returns freed blocks over 128 KiB-32 MiB to the OS at once, so a CPU
# engine's per-layer activations and page gathers fault fresh pages in every
# round; keeping them in the heap made the 110M model 7% faster on a uniform
# batch and 26% on a trace-shaped one (docs/operations.md). A value the
# driver's own environment sets wins.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def start_engines(cfg: ServeConfig, device: str = "cpu", gpus_per_engine: float = 0,
                  options: dict | None = None, placement: dict | None = None,
                  host: str | None = None, env: dict | None = None,
                  control: ControlPlane | None = None) -> list:
    """Create every engine the config's cluster shape names; returns
    [(name, role, actor)]. `placement` maps a role to a Ray custom resource
    its engines need (to pin roles to nodes); `host` is the address engines
    bind (None: their node's); `env` goes into their processes; `control`
    issues each its leaf on the control plane (None: plaintext)."""
    out = []
    for role, count in (("fused", cfg.cluster.fused), ("prefill", cfg.cluster.prefill),
                        ("decode", cfg.cluster.decode)):
        for i in range(count):
            name, actor = start_engine(cfg, role, i, device, gpus_per_engine, options,
                                       placement, host, env, control)
            out.append((name, role, actor))
    return out


def start_engine(cfg: ServeConfig, role: str, index: int, device: str = "cpu",
                 gpus_per_engine: float = 0, options: dict | None = None,
                 placement: dict | None = None, host: str | None = None,
                 env: dict | None = None, control: ControlPlane | None = None) -> tuple:
    """One engine actor (`pdserve:<role>-<index>`, restarted by Ray if its
    process dies); returns (name, actor). Also what the autoscaler adds.
    Its leaf (from `control`) travels in the actor's arguments, so a
    restart by Ray serves the same one."""
    if device == "cpu":
        env = {**{k: v for k, v in CPU_MALLOC_ENV.items() if k not in os.environ},
               **thread_env(cfg, role), **(env or {})}
    # a tensor-parallel engine's actor holds all its ranks' GPUs: its workers see them too
    ranks = role_engine(cfg, role).tensor_parallel_size
    opts = dict(name=actor_name(role, index), namespace=NAMESPACE, max_restarts=-1,
                num_cpus=0, num_gpus=gpus_per_engine * ranks, lifetime=None)
    if placement and role in placement:
        opts["resources"] = {placement[role]: 0.001}
    if env:
        opts["runtime_env"] = {"env_vars": dict(env)}
    tls = control.for_party(f"{role}-{index}") if control is not None else None
    actor = EngineActor.options(**opts).remote(cfg, role, index, device, options or {}, host,
                                               tls, time.time_ns() // 1_000_000)
    return f"{role}-{index}", actor
