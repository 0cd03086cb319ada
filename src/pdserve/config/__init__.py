"""The config YAML: one schema for serving and simulation.

    model: {path: DIR | FILE.gguf | preset: NAME, name: ..., dtype: auto, attention: auto,
            device: auto}
    engine: {...}                 # scheduler.EngineConfig fields
    cluster: {prefill: 1, decode: 1, fused: 0}   # in a given mapping an omitted count is 0;
                                  # a count may be {count: N, tensor_parallel_size: T}
    router: {max_requests: 4096, max_body_bytes: 8 MiB, protect_metrics: false,
             stream_interval: 1, replicas: 1}
    simulate: {gpu: h100, model: llama-3-8b}   # or {profile: PROFILE.yaml} (pdserve calibrate)
    transfer: {timeout_s: 30, lease_s: 10, heartbeat_s: 2}   # P/D: transfer/timeouts.py
    control_plane: {insecure: false, ca_cert: null, ca_key: null, cert: null, key: null,
                    server_name: pdserve-control, engine_host: null}   # proto/control_tls.py
    lora: {adapters: {NAME: DIR | {path: DIR, pinned: true}}, max_loras: 1, max_lora_rank: 16,
           max_cpu_loras: null}
    speculative: {method: ngram, num_speculative_tokens: 3, prompt_lookup_min: 2,
                  prompt_lookup_max: 4, gate: true}   # = engine.speculative (speculation.py)

Unknown keys are an error that names the key.

Each section is a frozen, validated dataclass in a module of its own
(`model.py`, `cluster.py`, `router.py`, `simulate.py`, `control_plane.py`,
`lora.py`, `autoscale.py`; `engine:` is scheduler/config.py's
`EngineConfig`, `transfer:` transfer/timeouts.py's `PeerTimeouts`);
`serve.py` joins them into `ServeConfig` and checks what spans sections;
`load.py` reads a file; `flags.py` puts the command line's flags over a
file's mapping (`pdserve up MODEL -tp 2`). Everything is imported from
`pdserve.config`.
"""

from pdserve.config.autoscale import AutoscaleConfig, RoleBounds
from pdserve.config.cluster import ClusterShape, check_cluster_tp
from pdserve.config.control_plane import ControlPlaneConfig
from pdserve.config.flags import Flags, model_source, with_flags
from pdserve.config.load import (
    UP_CONFIG, load_config, load_with_flags, shipped, shipped_names)
from pdserve.config.lora import LoraConfig
from pdserve.config.model import ATTENTION, DEVICES, DTYPES, QUANTIZATION, ModelConfig
from pdserve.config.router import RouterConfig
from pdserve.config.serve import (
    ServeConfig, engine_for_model, engine_gpus, role_engine, speculative_engine,
    transfer_from_dict)
from pdserve.config.simulate import SimulateConfig
from pdserve.scheduler.config import ConfigError, EngineConfig

__all__ = [
    "UP_CONFIG",
    "ATTENTION",
    "DEVICES",
    "DTYPES",
    "QUANTIZATION",
    "AutoscaleConfig",
    "ClusterShape",
    "ConfigError",
    "ControlPlaneConfig",
    "EngineConfig",
    "Flags",
    "LoraConfig",
    "ModelConfig",
    "RoleBounds",
    "RouterConfig",
    "ServeConfig",
    "SimulateConfig",
    "check_cluster_tp",
    "engine_for_model",
    "engine_gpus",
    "load_config",
    "load_with_flags",
    "model_source",
    "role_engine",
    "shipped",
    "shipped_names",
    "speculative_engine",
    "transfer_from_dict",
    "with_flags",
]
