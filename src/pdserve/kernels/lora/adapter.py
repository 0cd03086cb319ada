"""A LoRA adapter read from a PEFT checkpoint directory.

PEFT saves `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
`use_rslora`, ...) beside `adapter_model.safetensors`, whose tensors are
named `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`
([rank, in]) and `...lora_B.weight` ([out, rank]). A targeted projection's
weight becomes W + scaling * B @ A, scaling = alpha / rank (alpha / sqrt(rank)
under rsLoRA). We keep A as it is and B already scaled, so applying an
adapter is two matmuls and no multiply.

Only what the Llama family's decoder can serve is accepted: LoRA (not DoRA,
not bias training, not extra trained modules) on q, k, v, o, gate, up and
down; anything else is refused with what to change.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels.models.model_config import ModelConfig

ARCHS = ("llama", "mistral", "qwen2")      # the decoder (model.py) that applies LoRA
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\."
                  r"(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(ValueError):
    """A LoRA adapter pdserve cannot serve; says what was wrong and what to change."""


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a projection of the model."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[module]


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights: (layer, module) -> (A [rank, in], scaled B [out, rank])."""
    path: str
    rank: int                       # the largest rank of any targeted module
    alpha: float
    weights: dict

    @property
    def targets(self) -> frozenset:
        return frozenset(m for _, m in self.weights)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def load_adapter(path, cfg: ModelConfig, max_rank: int | None = None) -> LoraAdapter:
    """Read a PEFT LoRA directory for a model of config `cfg` (float32 on the CPU)."""
    d = Path(path)
    if cfg.arch not in ARCHS:
        raise AdapterError(f"LoRA adapters are served on the {', '.join(ARCHS)} families; "
                           f"this model is {cfg.arch}: serve it without lora")
    conf_file = d / "adapter_config.json"
    if not conf_file.is_file():
        raise AdapterError(f"LoRA adapter {str(d)!r} has no adapter_config.json; point at a "
                           "directory saved by PEFT's save_pretrained")
    conf = json.loads(conf_file.read_text())
    _check_config(conf, d)
    tensors = _read_tensors(d)
    alpha = float(conf.get("lora_alpha", conf.get("r", 8)))
    rslora = bool(conf.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _KEY.match(name)
        if m is None:
            raise AdapterError(f"LoRA adapter {str(d)!r} has tensor {name!r}, which pdserve "
                               f"cannot apply: it serves LoRA on {', '.join(MODULES)} of the "
                               "decoder layers only")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise AdapterError(f"LoRA adapter {str(d)!r} targets {module!r}; pdserve applies "
                               f"LoRA to {', '.join(MODULES)} only: retrain without it")
        if layer >= cfg.num_layers:
            raise AdapterError(f"LoRA adapter {str(d)!r} has layer {layer}, but the model has "
                               f"{cfg.num_layers}: it was trained for another base model")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise AdapterError(f"LoRA adapter {str(d)!r} holds no LoRA weights")
    weights, rank = {}, 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {str(d)!r}: layer {layer} {module} has lora_"
                               f"{''.join(ab)} without its pair; the checkpoint is incomplete")
        a, b = ab["A"].float(), ab["B"].float()
        out, inp = module_shape(cfg, module)
        r = a.shape[0]
        if a.shape != (r, inp) or b.shape != (out, r):
            raise AdapterError(
                f"LoRA adapter {str(d)!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, but this model needs A (rank, {inp}) and B ({out}, rank): "
                "it was trained for another base model")
        if max_rank is not None and r > max_rank:
            raise AdapterError(f"LoRA adapter {str(d)!r} has rank {r} (layer {layer} {module}), "
                               f"above lora.max_lora_rank={max_rank}; raise max_lora_rank")
        scaling = alpha / (math.sqrt(r) if rslora else r)
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
        rank = max(rank, r)
    return LoraAdapter(str(d), rank, alpha, weights)


def merged(base: dict, adapter: LoraAdapter) -> dict:
    """Hugging Face-named base weights with the adapter folded in (W + B A):
    the reference a batched LoRA must equal."""
    out = dict(base)
    for (layer, module), (a, b) in adapter.weights.items():
        part = "self_attn" if module in MODULES[:4] else "mlp"
        name = f"model.layers.{layer}.{part}.{module}.weight"
        w = base[name]
        out[name] = (w.float() + b @ a).to(w.dtype)
    return out


def _check_config(conf: dict, d: Path) -> None:
    kind = str(conf.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"adapter {str(d)!r} is a {kind} adapter; pdserve serves LORA only")
    refusals = [
        (conf.get("use_dora"), "uses DoRA (use_dora: true)"),
        (conf.get("fan_in_fan_out"), "stores weights fan-in first (fan_in_fan_out: true)"),
        (conf.get("modules_to_save"), f"trains whole modules too (modules_to_save: "
                                      f"{conf.get('modules_to_save')})"),
        (conf.get("bias", "none") != "none", f"trains biases (bias: {conf.get('bias')!r})"),
        (conf.get("alpha_pattern"), "sets a per-module alpha (alpha_pattern)"),
    ]
    for bad, what in refusals:
        if bad:
            raise AdapterError(f"LoRA adapter {str(d)!r} {what}, which pdserve cannot serve; "
                               "retrain as plain LoRA on q, k, v, o, gate, up, down")


def _read_tensors(d: Path) -> dict:
    f = d / "adapter_model.safetensors"
    if not f.is_file():
        raise AdapterError(f"LoRA adapter {str(d)!r} has no adapter_model.safetensors; save it "
                           "with save_pretrained(..., safe_serialization=True)")
    from safetensors.torch import load_file
    return load_file(str(f))
