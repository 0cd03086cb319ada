"""Model shapes served with seeded random weights: no checkpoint, nothing
downloaded, the weights drawn on the device itself (a Llama-3-8B-sized
model is 16 GB of bfloat16, which the host would take minutes to draw and
copy). As presets (`model: {preset: llama-3-8b-random}`) they let a GPU run
calibrate the simulator or serve a load at a real model's size, as vLLM's
`--load-format dummy` does; the GPU benchmarks build the same shapes. The
weights mean nothing: the tokenizer is the tiny preset's (printable
characters), and the tokens they generate are noise."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdserve.kernels.models.model_config import ModelConfig
from pdserve.kernels.models.moe.specs import MoeSpec

# ModelConfig fields of each shape (Llama architecture unless it names its arch)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=14336,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position=16384),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, intermediate_size=1536,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position=8192,
                         tie_word_embeddings=True),
    "llama-110m": dict(vocab_size=16000, hidden_size=768, num_layers=12, num_heads=12,
                       num_kv_heads=4, head_dim=64, intermediate_size=2048, max_position=4096),
    # Qwen3-30B-A3B's layer (128 experts of 768, top 8, renormalized) in 12
    # of its 48 layers: 15.6 GB of bfloat16 where the whole model is 61 GB
    "qwen3-30b-a3b-12l": dict(arch="qwen3_moe", vocab_size=151936, hidden_size=2048,
                              num_layers=12, num_heads=32, num_kv_heads=4, head_dim=128,
                              intermediate_size=6144, rms_norm_eps=1e-6, rope_theta=1e6,
                              max_position=40960,
                              moe=MoeSpec(128, 8, 768, tuple(range(12)), True)),
    "tiny": dict(vocab_size=98, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=160),
    "tiny-moe": dict(arch="qwen3_moe", vocab_size=98, hidden_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=160,
                     moe=MoeSpec(8, 2, 32, (0, 1), True)),
}
RANDOM_SUFFIX = "-random"
# the presets: every shape but the tiny ones (the tiny preset is already random, and embedded)
RANDOM_PRESETS = tuple(f"{s}{RANDOM_SUFFIX}" for s in SHAPES if not s.startswith("tiny"))
RANDOM_SEED = 20261206


def model_config(shape: str) -> ModelConfig:
    """The shape's config: a Llama unless it names its `arch`."""
    return ModelConfig(**{"arch": "llama", **SHAPES[shape]})


def random_preset_config(preset: str | None) -> ModelConfig | None:
    """The shape a random preset names, or None for any other preset: its
    tokenizer's BOS and EOS ids the tiny preset's, and bfloat16 its own
    dtype (the real checkpoints', and what model.dtype auto then runs)."""
    if preset is None or preset not in RANDOM_PRESETS:
        return None
    return dataclasses.replace(model_config(preset.removesuffix(RANDOM_SUFFIX)),
                               bos_token_id=96, eos_token_ids=(97,), torch_dtype="bfloat16")
