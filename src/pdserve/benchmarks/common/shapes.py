"""Model shapes the GPU benchmarks build with seeded random weights, drawn
on the device itself (nothing downloaded, nothing made on the host first:
a Llama-3-8B-sized model is 16 GB of bfloat16, which the host would take
minutes to draw and copy). What `bench capture` and `bench gpu` share."""

from __future__ import annotations

# ModelConfig fields of each shape (Llama architecture)
SHAPES = {
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=14336,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position=16384),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, intermediate_size=1536,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position=8192,
                         tie_word_embeddings=True),
    "llama-110m": dict(vocab_size=16000, hidden_size=768, num_layers=12, num_heads=12,
                       num_kv_heads=4, head_dim=64, intermediate_size=2048, max_position=4096),
    "tiny": dict(vocab_size=98, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=160),
}


def model_config(shape: str):
    from pdserve.kernels.models.model_config import ModelConfig

    return ModelConfig(arch="llama", **SHAPES[shape])  # type: ignore[arg-type]


def build(shape: str, dtype: str, device, attention: str = "torch"):
    """The model of `shape` in `dtype` on `device`, its `attention`
    backend (kernels compiled at load, as an engine's)."""
    import torch

    from pdserve.kernels.models.loader import attention_shape, build_model, load_backend
    from pdserve.kernels.models.model import random_weights

    cfg = model_config(shape)
    torch_dtype = getattr(torch, dtype)
    backend = load_backend(attention, device, torch_dtype, attention_shape(cfg))
    return build_model(cfg, random_weights(cfg, 0, torch_dtype, device), torch_dtype, device,
                       backend)
