"""`model:`: which checkpoint an engine serves (a path or a preset), its
dtype, attention backend, device and quantization, and the name clients
call it by."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.scheduler.config import ConfigError, check_keys

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION = ("auto", "torch", "flashinfer")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATION = ("auto", "none", "gguf")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    preset: str | None = "tiny"
    dtype: str = "auto"          # auto: the checkpoint's (float16, and a quantized GGUF where
                                 # the CPU has bfloat16 instructions, run as bfloat16 on CPU)
    attention: str = "auto"      # auto: flashinfer on CUDA where installed, else torch
    name: str | None = None      # the served model name (the API's "model"); see served_name
    device: str = "auto"         # auto: cpu, unless the command line says otherwise
    quantization: str = "auto"   # auto: a GGUF's Q4_0/Q4_1/Q8_0 weights multiplied quantized on
                                 # CPU where the kernels run (kernels/cpu/quantized.py), else
                                 # dequantized; gguf: the same or an error; none: dequantized
    expert_parallel: bool = False   # tensor_parallel_size > 1 with a MoE model: each rank
                                    # holds its share of the experts whole, instead of a
                                    # slice of every one (docs/tensor-parallel.md)

    @classmethod
    def from_dict(cls, data) -> "ModelConfig":
        data = check_keys(data, "model",
                          {"path", "preset", "dtype", "attention", "name", "device",
                           "quantization", "expert_parallel"})
        if "path" in data and "preset" in data:
            raise ConfigError("model takes either path or preset, not both; remove one")
        for key, allowed in (("dtype", DTYPES), ("attention", ATTENTION), ("device", DEVICES),
                             ("quantization", QUANTIZATION)):
            if key in data and data[key] not in allowed:
                raise ConfigError(f"model.{key} is {data[key]!r}; use one of "
                                  f"{', '.join(allowed)}")
        if "name" in data and (not isinstance(data["name"], str) or not data["name"].strip()):
            raise ConfigError(f"model.name is {data['name']!r}; give a non-empty string")
        if not isinstance(data.get("expert_parallel", False), bool):
            raise ConfigError(f"model.expert_parallel is {data['expert_parallel']!r}; use "
                              "true or false")
        extra = {k: data[k] for k in ("dtype", "attention", "name", "device", "quantization",
                                      "expert_parallel") if k in data}
        if "path" in data:
            return cls(path=str(data["path"]), preset=None, **extra)
        return cls(path=None, preset=str(data.get("preset", "tiny")), **extra)

    def device_for(self, flag: str | None = None) -> str:
        """Where the model runs: the command line's --device (or an API's
        device=) over model.device, and auto as cpu."""
        if flag is not None:
            return flag
        return "cpu" if self.device == "auto" else self.device

    @property
    def served_name(self) -> str:
        """What clients call the model: model.name, else the preset, else the
        checkpoint's file or folder name without .gguf."""
        if self.name:
            return self.name
        if self.path is None:
            return self.preset  # type: ignore[return-value]
        return Path(self.path.rstrip("/")).name.removesuffix(".gguf")
