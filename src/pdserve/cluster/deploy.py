"""Start and stop a deployment: a Ray cluster (local, or joined), the engine
actors, and the router.

`drain` lets every engine finish what it holds (SIGTERM or Ctrl-C of
`pdserve up` runs it before `stop`); an engine the router drains is
retired, its actor killed without restart.

A local deployment keeps every byte on the loopback interface: Ray, the
engines' gRPC servers and UCX (UCX_NET_DEVICES=lo) all use 127.0.0.1. A
joined cluster binds engines to their node's address and lets UCX choose
its devices (RDMA where there is some).

The control plane is mutual TLS by default, loopback included (other users
of a host reach its loopback ports): `start` makes the deployment's CA
(proto/control_tls.py) and each engine, the router and the autoscaler get
their credentials through their Ray actors' arguments.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import ray

from pdserve.cluster.actors import (
    NAMESPACE, AutoscalerActor, RouterActor, actor_name, engine_address, start_engine,
    start_engines)
from pdserve.config import ServeConfig, engine_for_model, engine_gpus
from pdserve.cluster.local_ray import init_local
from pdserve.router.router import (DRAIN_DEADLINE_S, DRAIN_SLACK_S, RequestError, Router,
                                    Security)
from pdserve.router.serve import serve
from pdserve.kernels.models.loader import load_tokenizer, model_config_for
from pdserve.proto.control_tls import ControlPlane

if TYPE_CHECKING:
    from ray.actor import ActorHandle


log = logging.getLogger("pdserve.deploy")

LOCAL_ENV = {"UCX_NET_DEVICES": "lo"}
# Ray starts its workers at nice 15, below the router and any client on the
# host. An engine's loop thread launches every round: at nice 15 it waited
# for a core 41% of the time under load on two cores, and the threads that
# hold its GIL were preempted while holding it. A local Ray of our own runs
# them at 0 (on a cluster: RAY_worker_niceness=0 on `ray start`).
ENGINE_NICENESS = 0


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT Ray address that nothing answers at is an error now: Ray
    would retry it for minutes, warning all the while. ("auto" and ray://
    addresses are Ray's to resolve.)"""
    import socket

    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")       # [::1]:6379
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"no Ray cluster answers at {address} ({e.strerror or e}): start one "
                         "with `ray start --head` there, or give --address the head's GCS "
                         "address (HOST:6379 by default)") from None


class Deployment:
    def __init__(self, cfg: ServeConfig, address: str | None = None, device: str | None = None,
                 num_cpus: int | None = None, gpus_per_engine: float | None = None,
                 engine_options: dict | None = None, placement: dict | None = None,
                 loopback: bool | None = None, security: Security = Security()):
        """`device`: over the config's model.device (auto: cpu).
        `gpus_per_engine`: Ray GPUs each engine actor takes; on CUDA it
        defaults to 1, one GPU per engine (with 0 Ray would give every
        engine the same GPU)."""
        self.cfg = cfg
        self.ray_address = address
        self.device = cfg.model.device_for(device)
        self.num_cpus = num_cpus
        self.gpus_per_engine = engine_gpus(self.device, gpus_per_engine)
        self.engine_options = engine_options or {}
        self.placement = placement
        self.security = security
        # keep engine traffic on 127.0.0.1: by default only when Ray is local
        self.loopback = (address is None) if loopback is None else loopback
        self.engines: list = []
        self.infos: list[dict] = []             # each engine's info() as it started
        self.router: Router | None = None
        self.replicas: list = []                # router actors beside self.router
        self.autoscaler: ActorHandle | None = None   # its actor, with an autoscale: section
        self.control: ControlPlane | None = None     # the control plane's CA, once started
        self._started_ray = False

    def start(self, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None) -> str:
        """Start Ray (unless joined), the engines and the router; returns the
        router's gRPC address (`http_address` too with `http_port`)."""
        if not ray.is_initialized():
            if self.ray_address:
                _check_reachable(self.ray_address)
                ray.init(address=self.ray_address, namespace=NAMESPACE, log_to_driver=False)
            else:
                # "local": a Ray of our own, never one found running on this machine
                init_local(address="local", num_cpus=self.num_cpus, namespace=NAMESPACE,
                           include_dashboard=False, log_to_driver=False,
                           _node_ip_address="127.0.0.1",
                           _system_config={"worker_niceness": ENGINE_NICENESS})
            self._started_ray = True
        self._check_gpus()
        local = self.loopback
        self.control = self._control_plane()
        engine_host = self.cfg.control_plane.engine_host or ("127.0.0.1" if local else None)
        self.engines = start_engines(self.cfg, self.device, self.gpus_per_engine,
                                     self.engine_options, self.placement,
                                     host=engine_host, env=LOCAL_ENV if local else None,
                                     control=self.control)
        infos = self.infos = ray.get([a.info.remote() for _, _, a in self.engines])
        for line in niceness_warnings(infos):
            log.warning("%s", line)
        m = self.cfg.model
        tok = load_tokenizer(m.path, m.preset)
        model_cfg = model_config_for(m.path, m.preset)
        cfg = dataclasses.replace(self.cfg, engine=engine_for_model(   # as the engines do
            self.cfg.engine, self.cfg.engine_overrides, model_cfg.max_position))
        def resolve(name: str) -> str:
            return engine_address(name, lambda: self.actor(name))
        engines = [(i["engine"], i["role"], i["address"]) for i in infos]
        if self.control is not None:
            self.security = dataclasses.replace(self.security,
                                                control_tls=self.control.for_party("router"))
        self.router = Router(cfg, tok, model_cfg.vocab_size, engines, resolve, self.security,
                             retire=self._retire, full_history=model_cfg.full_history)
        address = serve(self.router, host, port, http_port)
        # the other replicas bind the ports this one got (SO_REUSEPORT)
        bound = int(address.rsplit(":", 1)[1])
        http_bound = int(self.router.http_address.rsplit(":", 1)[1]) \
            if self.router.http_address else None
        self.replicas = [RouterActor.options(num_cpus=0, namespace=NAMESPACE).remote(
            cfg, engines, self.security, host, bound, http_bound)
            for _ in range(cfg.router.replicas - 1)]
        ray.get([r.info.remote() for r in self.replicas])
        if cfg.autoscale is not None:
            # Ray types remote() as ActorHandle | the class itself (its ActorProxy)
            self.autoscaler = AutoscalerActor.options(  # type: ignore[assignment]
                num_cpus=0, namespace=NAMESPACE).remote(
                address, cfg, self.device, self.gpus_per_engine, self.engine_options,
                engine_host, self.security.api_key, self.control, start_engine=start_engine)
        return address

    def _control_plane(self) -> ControlPlane | None:
        """The deployment's credentials on the control plane: a CA made now
        (or the user's, from control_plane:), or None with a warning when
        the config turns it off."""
        control = self.cfg.control_plane.credentials()
        if control is None:
            log.warning("the control plane is insecure (--insecure-control-plane or "
                        "control_plane.insecure): anyone who reaches an engine's port can "
                        "submit, abort or drain its work and join as a peer that receives "
                        "KV pages; use it only on a network no one else reaches")
        return control

    def _check_gpus(self) -> None:
        """Engines that need more GPUs than Ray has would wait for them
        without a word: refused on a Ray of our own (nothing will add any),
        said on a joined one (its autoscaler may add nodes)."""
        c = self.cfg.cluster
        need = (c.fused + c.prefill + c.decode) * self.gpus_per_engine
        have = ray.cluster_resources().get("GPU", 0)
        if need <= have:
            return
        what = (f"{c.fused + c.prefill + c.decode} engines at {self.gpus_per_engine:g} GPU "
                f"each need {need:g} GPUs and Ray has {have:g}")
        if self._started_ray and not self.ray_address:
            self.stop()
            raise ValueError(f"{what} on this machine; run on CPU (--device cpu, or "
                             "model.device: cpu) or on a machine with the GPUs")
        log.warning("%s now: the engines wait until Ray's autoscaler adds GPU nodes", what)

    def _serving(self) -> Router:
        """The router start() made; a RuntimeError before it."""
        if self.router is None:
            raise RuntimeError("the deployment has no router yet: call start() first")
        return self.router

    @property
    def address(self) -> str:
        address = self._serving().address
        assert address is not None              # serve() set it before start() returned
        return address

    @property
    def http_address(self) -> str | None:
        return self._serving().http_address

    def actor(self, name: str):
        """An engine's actor: one started with the deployment, or one the
        autoscaler added (found by its Ray name); ValueError if none."""
        for n, _, a in self.engines:
            if n == name:
                return a
        role, _, index = name.removeprefix("pdserve:").rpartition("-")
        return ray.get_actor(actor_name(role, int(index)), namespace=NAMESPACE)

    def restart_router(self, host: str = "127.0.0.1", port: int = 0,
                       http_port: int | None = None) -> str:
        """Stop the router and start a fresh one over the same engines."""
        old = self._serving()
        old.stop()
        self.router = Router(old.cfg, old.tokenizer, old.vocab_size,
                             [(e.name, e.role, e.address) for e in old.engines.values()],
                             old.resolver, old.security, retire=old.retire,
                             full_history=old.full_history)
        return serve(self.router, host, port, http_port)

    def _autoscaled(self) -> list[str]:
        """Engine actors in the namespace this deployment did not start (the
        autoscaler's, added or still starting)."""
        ours = {name for name, _, _ in self.engines}
        try:
            named = ray.util.list_named_actors(all_namespaces=True)
        except Exception:                       # Ray already gone
            return []
        return [a["name"].removeprefix("pdserve:") for a in named
                if a.get("namespace") == NAMESPACE and a["name"].startswith("pdserve:")
                and a["name"].removeprefix("pdserve:") not in ours
                and a["name"].removeprefix("pdserve:").rpartition("-")[0] in
                ("fused", "prefill", "decode")]

    def _retire(self, name: str) -> None:
        """An engine drained and stopped: its actor goes, never restarted."""
        ray.kill(self.actor(name), no_restart=True)

    def drain(self, deadline_s: float = DRAIN_DEADLINE_S) -> dict[str, str]:
        """Drain every engine at once: no new request is taken, each finishes
        what it holds, what is left at the deadline is aborted. Returns a
        line per engine saying how it ended. The autoscaler looks no more
        first: it would add engines the drain does not cover."""
        if self.autoscaler is not None:
            try:
                ray.get(self.autoscaler.stop.remote(), timeout=60)
            except Exception:                   # already gone
                pass
        router = self._serving()
        results = router.run_sync(router.drain_all(deadline_s),
                                  timeout=deadline_s + DRAIN_SLACK_S + 10)
        out = {}
        for name, r in results.items():
            if isinstance(r, RequestError):
                out[name] = f"not drained: {r.message}"
            elif isinstance(r, BaseException):
                raise r
            else:
                how = (f"deadline passed, {r.aborted} aborted" if r.deadline_passed
                       else "every request finished")
                out[name] = (f"drained in {r.seconds:.1f} s ({r.requests_at_start} live "
                             f"at start; {how})")
        return out

    def take_rounds(self) -> list[list]:
        """Each engine's timed rounds since the last call (`Round`s, engine
        by engine in `self.engines`' order): what calibration and
        sim-accuracy hold a cost profile against."""
        return [ray.get(a.take_rounds.remote()) for _, _, a in self.engines]

    def autoscale_history(self) -> list:
        """What the autoscaler did, oldest first; empty without one."""
        if self.autoscaler is None:
            return []
        return ray.get(self.autoscaler.history.remote(), timeout=30)

    def errors(self) -> dict[str, list[str]]:
        """Failures the engines' loops and the router's watcher logged and
        served on after ('round failed'): a healthy run has none. An engine
        that cannot answer (killed on purpose) is left out."""
        out = {}
        if self.router is not None and self.router.errors:
            out["router"] = list(self.router.errors)
        for name, _, actor in self.engines:
            try:
                errs = ray.get(actor.check.remote(), timeout=10)["loop_errors"]
            except Exception:                   # gone or restarting: nothing to read
                continue
            if errs:
                out[name] = errs
        return out

    def stop(self) -> None:
        if self.autoscaler is not None:
            try:
                ray.get(self.autoscaler.stop.remote(), timeout=60)
            except Exception:                   # already gone
                pass
            ray.kill(self.autoscaler, no_restart=True)
            self.autoscaler = None
        added = [n for n in (self.router.engines if self.router else {})
                 if n not in {name for name, _, _ in self.engines}]
        for replica in self.replicas:
            try:
                ray.get(replica.stop.remote(), timeout=20)
            except Exception:                   # already gone
                pass
            ray.kill(replica, no_restart=True)
        self.replicas = []
        if self.router is not None:
            self.router.stop()
        actors = [actor for _, _, actor in self.engines]
        for name in added + self._autoscaled():   # the autoscaler's, if still there
            try:
                actor = self.actor(name)
            except ValueError:
                continue
            if actor not in actors:
                actors.append(actor)
        for actor in actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=20)
            except Exception:                   # already gone: nothing to stop
                pass
            ray.kill(actor, no_restart=True)
        self.engines = []
        if self._started_ray:
            ray.shutdown()


def niceness_warnings(infos: list[dict]) -> list[str]:
    """A line for each engine that runs below normal priority (a joined
    Ray started without RAY_worker_niceness=0)."""
    return [f"{i['engine']} runs at nice {i['niceness']} (Ray's worker default is 15), below "
            "the router and the clients on its host, so its rounds wait for a core under "
            "load: start Ray with RAY_worker_niceness=0 on every node"
            for i in infos if i["niceness"] > 0]
