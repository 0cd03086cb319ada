"""`ServeConfig`: the whole file, its sections joined, and the checks that
span sections (autoscale bounds against the cluster's start, LoRA against
replicas and tensor parallelism, the top-level `speculative:`); with the
`transfer:` section, and the engine settings a role, a model and a device
come to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.config.autoscale import AutoscaleConfig
from pdserve.config.cluster import ClusterShape, check_cluster_tp
from pdserve.config.control_plane import ControlPlaneConfig
from pdserve.config.lora import LoraConfig
from pdserve.config.model import ModelConfig
from pdserve.config.router import RouterConfig
from pdserve.config.simulate import SimulateConfig
from pdserve.scheduler.config import ConfigError, EngineConfig, check_keys
from pdserve.transfer.timeouts import CONFIG_NAMES, PeerTimeouts


def transfer_from_dict(data) -> PeerTimeouts:
    """`transfer:`: D's landing timeout, P's lease, D's heartbeat, checked
    against each other (transfer/timeouts.py says why each relation keeps
    pages safe)."""
    data = check_keys(data, "transfer", {"timeout_s", "lease_s", "heartbeat_s"})
    d = PeerTimeouts()
    t = PeerTimeouts(transfer_s=data.get("timeout_s", d.transfer_s),
                     lease_s=data.get("lease_s", d.lease_s),
                     heartbeat_s=data.get("heartbeat_s", d.heartbeat_s))
    problems = t.problems(CONFIG_NAMES)
    if problems:
        raise ConfigError("; ".join(problems))
    return t


@dataclass(frozen=True)
class ServeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cluster: ClusterShape = field(default_factory=ClusterShape)
    router: RouterConfig = field(default_factory=RouterConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    autoscale: object = None                    # AutoscaleConfig, or None: a fixed shape
    transfer: PeerTimeouts = field(default_factory=PeerTimeouts)
    control_plane: ControlPlaneConfig = field(default_factory=ControlPlaneConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    engine_overrides: frozenset = frozenset()   # engine keys the file set explicitly
    model_given: bool = False                   # the file has a model: section

    @classmethod
    def from_dict(cls, data, base: Path | None = None) -> "ServeConfig":
        """`base`: the folder relative paths in the file are read from."""
        data = check_keys(data, "config", {"model", "engine", "cluster", "router", "simulate",
                                           "autoscale", "transfer", "control_plane",
                                           "lora", "speculative"})
        engine = data.get("engine") or {}
        if data.get("speculative") is not None:
            engine = speculative_engine(engine, data["speculative"])
        autoscale = None
        if data.get("autoscale") is not None:
            autoscale = AutoscaleConfig.from_dict(data["autoscale"])
            shape = ClusterShape.from_dict(data.get("cluster"))
            for role in ("prefill", "decode"):
                n, b = getattr(shape, role), autoscale.bounds(role)
                if not b.min <= n <= b.max:
                    raise ConfigError(f"cluster.{role}: {n} engines to start with, outside "
                                      f"autoscale.{role} [{b.min}, {b.max}]; start within "
                                      "the bounds the autoscaler keeps")
            replicas = (data.get("router") or {}).get("replicas", 1)
            if replicas != 1:
                raise ConfigError(f"autoscale with router.replicas={replicas}: the autoscaler "
                                  "adds engines through one router; use one replica")
        lora = LoraConfig.from_dict(data.get("lora"), base)
        replicas = (data.get("router") or {}).get("replicas", 1)
        if lora.runtime_updates and replicas != 1:
            raise ConfigError(f"lora.runtime_updates with router.replicas={replicas}: each "
                              "replica would load adapters under ids of its own; use one "
                              "replica")
        engine_cfg = EngineConfig.from_dict(engine)
        cluster = ClusterShape.from_dict(data.get("cluster"))
        check_cluster_tp(engine_cfg, cluster)
        if lora.enabled and any(cluster.tp_size(r, engine_cfg.tensor_parallel_size) > 1
                                for r in ("fused", "prefill", "decode") if getattr(cluster, r)):
            raise ConfigError("lora with tensor_parallel_size > 1: LoRA adapters under tensor "
                              "parallelism are not built (the adapters' matrices are not "
                              "sharded); serve adapters from engines of tensor_parallel_size 1")
        return cls(
            model=ModelConfig.from_dict(data.get("model")),
            engine=engine_cfg,
            cluster=cluster,
            router=RouterConfig.from_dict(data.get("router")),
            simulate=SimulateConfig.from_dict(data.get("simulate")),
            autoscale=autoscale,
            transfer=transfer_from_dict(data.get("transfer")),
            control_plane=ControlPlaneConfig.from_dict(data.get("control_plane")),
            lora=lora,
            engine_overrides=frozenset(engine) if isinstance(engine, dict) else frozenset(),
            model_given=data.get("model") is not None,
        )


def role_engine(cfg: "ServeConfig", role: str) -> EngineConfig:
    """The engine settings `role`'s engines run: the engine section at the
    role's tensor-parallel size."""
    t = cfg.cluster.tp_size(role, cfg.engine.tensor_parallel_size)
    if t == cfg.engine.tensor_parallel_size:
        return cfg.engine
    return dataclasses.replace(cfg.engine, tensor_parallel_size=t)
def speculative_engine(engine, spec) -> dict:
    """The engine section with the top-level `speculative:` (where `pdserve
    up --speculative-config` puts its JSON) as its `speculative` key;
    refused if the engine section sets one too."""
    if not isinstance(engine, dict):
        raise ConfigError(f"engine must be a mapping, got {type(engine).__name__}")
    if engine.get("speculative") is not None:
        raise ConfigError("speculative: is set both at the top level and as "
                          "engine.speculative; keep one")
    return {**engine, "speculative": spec}


def engine_gpus(device: str, gpus_per_engine: float | None) -> float:
    """Ray GPUs per engine: 1 on CUDA unless given. 0 on CUDA is refused:
    Ray then sets no CUDA_VISIBLE_DEVICES and every engine lands on cuda:0."""
    on_cuda = device.startswith("cuda")
    if gpus_per_engine is None:
        return 1 if on_cuda else 0
    if on_cuda and gpus_per_engine <= 0:
        raise ValueError(
            f"--gpus-per-engine {gpus_per_engine:g} with device cuda would put every engine "
            "on the same GPU (cuda:0); give 1 for a GPU each (the default on cuda), or a "
            "fraction such as 0.5 to share GPUs knowingly")
    if gpus_per_engine < 0:
        raise ValueError(f"--gpus-per-engine must be >= 0, got {gpus_per_engine:g}")
    return gpus_per_engine


def engine_for_model(engine: EngineConfig, set_keys, max_position: int) -> EngineConfig:
    """The engine config a model runs with: max_context_tokens is the
    model's context unless the config set it, and never beyond it (RoPE
    tables and the model's training end there)."""
    if "max_context_tokens" not in set_keys:
        return dataclasses.replace(engine, max_context_tokens=max_position)
    if engine.max_context_tokens > max_position:
        raise ConfigError(f"engine.max_context_tokens={engine.max_context_tokens:,} exceeds the "
                          f"model's context of {max_position:,} tokens; lower it or leave it "
                          "unset (the model's context is the default)")
    return engine
