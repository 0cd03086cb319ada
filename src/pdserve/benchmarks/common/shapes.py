"""The model shapes the GPU benchmarks build (kernels/models/shapes.py,
whose random presets an engine serves too), with seeded random weights
drawn on the device, and their attention backend: what `bench capture`
and `bench gpu` share."""

from __future__ import annotations

from pdserve.kernels.models.shapes import SHAPES, model_config  # noqa: F401  (re-exported)


def build(shape: str, dtype: str, device, attention: str = "torch"):
    """The model of `shape` in `dtype` on `device`, its `attention`
    backend (kernels compiled at load, as an engine's)."""
    import torch

    from pdserve.kernels.models.loader import (attention_shape, build_model,
                                               checkpoint_weight_names, load_backend)
    from pdserve.kernels.models.model import random_weights

    cfg = model_config(shape)
    torch_dtype = getattr(torch, dtype)
    backend = load_backend(attention, device, torch_dtype, attention_shape(cfg))
    weights = random_weights(cfg, 0, torch_dtype, device, checkpoint_weight_names(cfg))
    return build_model(cfg, weights, torch_dtype, device, backend)
