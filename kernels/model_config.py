"""The architecture facts a decoder needs, read from a Hugging Face
config.json or a GGUF file's metadata, or the embedded tiny preset."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# config.json's model_type, for checkpoints that do not list architectures
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


class ModelError(ValueError):
    """A model directory or preset pdserve cannot load; says what to change."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple = field(default_factory=tuple)
    torch_dtype: str | None = None     # the checkpoint's own dtype, for dtype: auto


def tiny_config() -> ModelConfig:
    """The embedded default: a small Llama over printable characters."""
    return ModelConfig(arch="llama", vocab_size=98, hidden_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=160,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position=4096,
                       tie_word_embeddings=False, bos_token_id=96, eos_token_ids=(97,))


def read_config(path) -> ModelConfig:
    """The config of a checkpoint directory, or of a .gguf file (its metadata
    only: no tensor is read)."""
    d = Path(path)
    if str(d).lower().endswith(".gguf"):
        from pdserve.kernels.gguf import open_gguf

        return open_gguf(d).config
    if not d.is_dir():
        what = "is a file, not a directory" if d.exists() else "does not exist"
        raise ModelError(f"model directory {str(d)!r} {what}; set model.path to a Hugging "
                         "Face checkpoint directory or a .gguf file, or use model: {preset: tiny}")
    config_file = d / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{d} has no config.json; point model.path at a Hugging Face "
                         "checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    raw = json.loads(config_file.read_text())
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None) if archs \
        else MODEL_TYPES.get(raw.get("model_type"))
    if arch is None:
        raise ModelError(f"{d}: architecture {archs or raw.get('model_type')!r} is not "
                         f"supported; pdserve runs {', '.join(sorted(SUPPORTED))}")
    heads = raw["num_attention_heads"]
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    # transformers 5 writes rope_parameters; older checkpoints rope_scaling + rope_theta
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                          else None)
    window = raw.get("sliding_window")
    if arch == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    return ModelConfig(
        arch=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        max_position=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or raw.get("attention_bias", False),
        sliding_window=window,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        # transformers 5 writes dtype; earlier versions torch_dtype
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )
