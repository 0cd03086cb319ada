"""Which attention backend a model runs, and why: the torch reference
(attention.py) everywhere, or flashinfer (flashinfer_attention.py) on CUDA
where it is installed and has kernels for the model. The one module that
knows both, so neither imports the other's chooser."""

from __future__ import annotations

import torch

from pdserve.kernels.attention import TorchAttention
from pdserve.kernels.flashinfer_attention import (FLASHINFER_DTYPES, FLASHINFER_HEAD_DIMS,
                                                  FlashInferAttention)


def choose_backend(name: str, device, dtype: torch.dtype, **kw):
    """(backend, why): 'auto' picks flashinfer on CUDA when it is installed
    and has kernels for the model (float16 or bfloat16, head_dim 64, 128 or
    256), else torch. Asking for flashinfer where it cannot run is an error
    that says why."""
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}; use auto, torch or flashinfer")
    on_cuda = torch.device(device).type == "cuda"
    if name == "torch":
        return TorchAttention(**kw), "model.attention is torch"
    if not on_cuda and name == "auto":
        return TorchAttention(**kw), f"auto on {device}: flashinfer runs on CUDA only"
    unfit = None
    if not on_cuda:
        unfit = f"flashinfer runs on CUDA only, and this model is on {device}"
    elif dtype not in FLASHINFER_DTYPES:
        unfit = f"flashinfer has no {str(dtype).removeprefix('torch.')} kernels; " \
                "set model.dtype to bfloat16 or float16"
    elif kw["head_dim"] not in FLASHINFER_HEAD_DIMS:
        unfit = f"flashinfer has no kernels for head_dim {kw['head_dim']} " \
                f"(it has {', '.join(map(str, FLASHINFER_HEAD_DIMS))})"
    if unfit is None:
        try:
            return FlashInferAttention(**kw), (
                f"model.attention is {name}; flashinfer {FlashInferAttention.BACKEND} kernels "
                f"for {str(dtype).removeprefix('torch.')}, head_dim {kw['head_dim']}")
        except ImportError:
            unfit = "attention backend 'flashinfer' needs the gpu extra: " \
                    "pip install 'pdserve[gpu]' on a CUDA machine"
    if name == "flashinfer":
        raise ValueError(f"attention: flashinfer cannot serve this model: {unfit} "
                         "(or use attention: auto or torch)")
    return TorchAttention(**kw), f"auto fell back to torch: {unfit}"


def make_backend(name: str, device, dtype: torch.dtype, **kw):
    """The backend `choose_backend` picks, without the reason."""
    return choose_backend(name, device, dtype, **kw)[0]
