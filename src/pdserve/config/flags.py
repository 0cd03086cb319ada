"""The command line over a config file: `pdserve up`'s flags (vLLM's and
SGLang's names for the model, its dtype, tensor parallelism, the engine
counts and the request limits, and pdserve's own) merged into the file's
mapping, never into the ServeConfig built from it. The deployment then
runs from one mapping, which `pdserve up` prints as YAML: what ran, in a
form `--config` takes back.

    file (or {}) --rebased--> its mapping, paths absolute --with_flags--> the
    mapping run --ServeConfig.from_dict--> the config (every check as a file's)

A flag given replaces what the file says of the same setting; a flag not
given (None) leaves the file's setting, or the default, alone."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.config.lora import lora_module
from pdserve.scheduler.config import ConfigError

ROLES = ("prefill", "decode", "fused")
CERTIFICATES = ("ca_cert", "ca_key", "cert", "key")
# flag -> the engine key it sets (vLLM's names; SGLang's are aliases on the parser)
ENGINE_LIMITS = {"max_model_len": "max_context_tokens",
                 "max_num_seqs": "max_batch_size",
                 "max_num_batched_tokens": "max_scheduled_tokens"}


@dataclass(frozen=True)
class Flags:
    """What the command line says about the config; None: it says nothing."""
    model_path: str | None = None       # a checkpoint directory or a .gguf file ...
    model_preset: str | None = None     # ... or a preset (one of the two, at most)
    served_model_name: str | None = None
    dtype: str | None = None
    device: str | None = None           # auto, cpu or cuda (model.device)
    tensor_parallel_size: int | None = None
    enable_expert_parallel: bool | None = None   # model.expert_parallel (vLLM's flag)
    prefill: int | None = None          # any count given: the counts given name every
    decode: int | None = None           # engine there is, as a cluster: mapping does
    fused: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    lora_modules: tuple[str, ...] = ()  # NAME=PATH or vLLM's JSON form
    max_loras: int | None = None
    speculative_config: str | None = None   # JSON
    insecure_control_plane: bool = False

    def __post_init__(self) -> None:
        if self.model_path is not None and self.model_preset is not None:
            raise ConfigError("a model is a path or a preset, not both; give one")


def with_flags(data, flags: Flags) -> dict:
    """The config mapping `data` (a file's, paths already absolute: see
    load.rebased) with `flags` over it. Pure: the result is what ServeConfig
    validates, as if a file had said it."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"a config is a mapping of sections, got {type(data).__name__}")
    out = dict(data)
    out = _model(out, flags)
    out = _engine(out, flags)
    out = _cluster(out, flags)
    if flags.lora_modules or flags.max_loras is not None:
        out["lora"] = _lora(_section(out, "lora"), flags)
    if flags.speculative_config is not None:
        out = _speculative(out, flags.speculative_config)
    if flags.insecure_control_plane:
        cp = {k: v for k, v in _section(out, "control_plane").items() if k not in CERTIFICATES}
        out["control_plane"] = {**cp, "insecure": True}
    return out


def _section(data: dict, name: str) -> dict:
    """A section as a mapping to change (a copy); absent or null: empty."""
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a mapping, got {type(value).__name__}")
    return dict(value)


def _model(data: dict, flags: Flags) -> dict:
    model = _section(data, "model")
    if flags.model_path is not None or flags.model_preset is not None:
        # the file's name was its model's: the new one is called by its own
        for key in ("path", "preset", "name"):
            model.pop(key, None)
        if flags.model_path is not None:
            model["path"] = flags.model_path
        else:
            model["preset"] = flags.model_preset
    for key, value in (("name", flags.served_model_name), ("dtype", flags.dtype),
                       ("device", flags.device), ("expert_parallel", flags.enable_expert_parallel)):
        if value is not None:
            model[key] = value
    if not model:
        return data
    # the model first, as a file says it
    return {"model": model, **{k: v for k, v in data.items() if k != "model"}}


def _engine(data: dict, flags: Flags) -> dict:
    sets = {key: getattr(flags, flag) for flag, key in ENGINE_LIMITS.items()
            if getattr(flags, flag) is not None}
    if flags.tensor_parallel_size is not None:
        sets["tensor_parallel_size"] = flags.tensor_parallel_size
    if not sets:
        return data
    return {**data, "engine": {**_section(data, "engine"), **sets}}


def _cluster(data: dict, flags: Flags) -> dict:
    """The counts given name every engine (an omitted role: 0, as in a
    file's `cluster:`); a role's own tensor_parallel_size in the file stays
    with its new count. --tensor-parallel-size sets every role's size: the
    roles' own sizes go."""
    counts = {r: getattr(flags, r) for r in ROLES if getattr(flags, r) is not None}
    if not counts and flags.tensor_parallel_size is None:
        return data
    old = _section(data, "cluster")
    if not counts:
        if not old:
            return data
        counts = {r: v["count"] if isinstance(v, dict) and "count" in v else v
                  for r, v in old.items()}
    cluster: dict = {}
    for role, n in counts.items():
        was = old.get(role)
        if flags.tensor_parallel_size is None and isinstance(was, dict) \
                and "tensor_parallel_size" in was:
            cluster[role] = {"count": n, "tensor_parallel_size": was["tensor_parallel_size"]}
        else:
            cluster[role] = n
    return {**data, "cluster": cluster}


def _lora(lora: dict, flags: Flags) -> dict:
    """--lora-modules over the file's adapters of the same name (the
    flag's pinning with it), --max-loras over its slots. A flag's path is
    relative to where the command runs: made absolute here, as a file's
    are made absolute beside the file."""
    adapters = lora.get("adapters") or {}
    if not isinstance(adapters, dict):
        raise ConfigError(f"lora.adapters must map names to PEFT directories "
                          f"({{name: path}}), got {adapters!r}")
    adapters = dict(adapters)
    for m in flags.lora_modules:
        name, path, pin = lora_module(m)
        path = os.path.abspath(path)
        adapters[name] = {"path": path, "pinned": True} if pin else path
    if adapters:
        lora["adapters"] = adapters
    if flags.max_loras is not None:
        lora["max_loras"] = flags.max_loras
    return lora


def _speculative(data: dict, text: str) -> dict:
    """--speculative-config's JSON as the top-level `speculative:`, replacing
    the file's wherever it was given; the file's decode_input_tokens went
    with the file's speculation (1 + its k), so it goes too."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config: not JSON ({e}); give an object such as "
                          "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"--speculative-config: give a JSON object, got "
                          f"{type(spec).__name__}")
    engine = _section(data, "engine")
    for key in ("speculative", "decode_input_tokens"):
        engine.pop(key, None)
    out = {**data, "speculative": spec}
    if "engine" in data:
        out["engine"] = engine
    return out


def model_source(value: str, presets) -> dict:
    """MODEL as given on the command line, as Flags' model fields: a path
    that exists (made absolute, so the config printed runs from anywhere),
    else a preset of that name, else a path (whose absence the loader
    reports, naming it)."""
    if not Path(value).exists() and value in presets:
        return {"model_preset": value}
    return {"model_path": os.path.abspath(value)}
