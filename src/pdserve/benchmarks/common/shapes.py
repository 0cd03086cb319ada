"""Model shapes the GPU benchmarks build with seeded random weights, on the
device itself (nothing downloaded, nothing made on the host first): a
Llama-3-8B-sized model is 16 GB of bfloat16, which the host would take
minutes to draw and copy. What `bench capture` and `bench gpu` share."""

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


def device_weights(cfg, dtype, device, seed: int = 0) -> dict:
    """Hugging Face-named weights for `cfg` drawn on `device` in `dtype`
    (scaled as model.random_weights scales them; norms 1)."""
    import torch

    from pdserve.kernels.models.model_config import weight_names

    g = torch.Generator(device=device).manual_seed(seed)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"embed_tokens": (cfg.vocab_size, h), "lm_head": (cfg.vocab_size, h),
              "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    out = {}
    for name in weight_names(cfg):
        key = name.split(".")[-2]
        if name.endswith("norm.weight"):
            out[name] = torch.ones(h, dtype=dtype, device=device)
            continue
        shape = (shapes[key][0],) if name.endswith(".bias") else shapes[key]
        w = torch.empty(shape, dtype=dtype, device=device)
        out[name] = w.normal_(0.0, 0.5 / shape[-1] ** 0.5, generator=g)
    return out


def build(shape: str, dtype: str, device, attention: str = "torch"):
    """The model of `shape` in `dtype` on `device`, its `attention`
    backend (kernels compiled at load, as an engine's)."""
    import torch

    from pdserve.kernels.models.loader import attention_shape, build_model, load_backend

    cfg = model_config(shape)
    torch_dtype = getattr(torch, dtype)
    backend = load_backend(attention, device, torch_dtype, attention_shape(cfg))
    return build_model(cfg, device_weights(cfg, torch_dtype, device), torch_dtype, device,
                       backend)
