"""The elementwise ops between a Llama-family layer's matmuls, and which
implementation a model runs: its RMS norms, its residual adds and
SwiGLU's silu(gate) * up.

torch runs each as its own calls (a norm two, an add one, SwiGLU two),
each a kernel or more, which on a GPU at decode batch sizes costs launches
and passes over memory, not arithmetic. flashinfer fuses them: a residual add and the next
norm in one kernel (`fused_add_rmsnorm`), SwiGLU in one (`silu_and_mul`).

`choose_fused_ops` picks once, at model build: flashinfer's on CUDA in
float16 or bfloat16 where it is installed and its kernels build, torch's
everywhere else. torch's are the forward's own expressions, so on CPU (and
in float32) a model computes what it always did, bit for bit. flashinfer's
compute in float32 and round once, so their bits differ from torch's
within the dtype's rounding; each is row by row, so a row's bits still do
not depend on what shares its round.

The interface is the residual stream's: `add_rms_norm(delta, h, w)` is
"h = h + delta; x = norm(h) * w" and returns (x, h). flashinfer's writes
both in place (h into `h`, x into `delta`), so a caller hands it only
tensors the forward made and reads neither argument again, only what it
returns.

Rotary positions stay torch's (models/rope.py): flashinfer's
`apply_rope_with_cos_sin_cache_inplace` wants a float32 cos|sin table of
its own layout and rotates q and k in place inside the qkv rows, which
would hand both attention backends and the K/V write strided q and k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.models.model_config import ModelConfig

# flashinfer's norm and activation kernels are half precision only
FUSED_DTYPES = (torch.float16, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalized in float32, cast back, then
    scaled by `weight`. torch's fused rms_norm (no weight given) does the
    first two in one call where the formula took six, to the same bits in
    float32 and bfloat16 alike; the weight multiplies after the cast, as
    there."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


class TorchOps:
    """The reference: torch's kernels, Hugging Face's rounding."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, delta: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + delta) * weight, h + delta)."""
        h = h + delta
        return rms_norm(h, weight, eps), h

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(first half) * second half, of [rows, 2 * inter]."""
        inter = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


TORCH_OPS = TorchOps()


class FlashInferOps(TorchOps):
    """flashinfer's fused kernels (CUDA, float16 or bfloat16). `flashinfer`
    is the imported module: `choose_fused_ops` imports it, a test may hand
    in a stand-in to run this path on CPU."""

    name = "flashinfer"

    def __init__(self, flashinfer):
        self._norm = flashinfer.norm
        self._act = flashinfer.activation

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not x.shape[0]:              # no rows: an empty launch is the kernel's error
            return super().rms_norm(x, weight, eps)
        return self._norm.rmsnorm(x, weight, eps)

    def add_rms_norm(self, delta: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._norm.fused_add_rmsnorm(delta, h, weight, eps)
        return delta, h

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act.silu_and_mul(gate_up)

    def warm_up(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        """Each kernel once on one row of the model's widths: flashinfer
        builds a kernel the first time it runs (or loads it from its cache),
        so this moves that to load time, and a kernel that cannot run here
        fails here, not mid-serving."""
        h = torch.ones(1, cfg.hidden_size, dtype=dtype, device=device)
        w = torch.ones(cfg.hidden_size, dtype=dtype, device=device)
        x = self.rms_norm(h, w, cfg.rms_norm_eps)
        self.add_rms_norm(x, h, w, cfg.rms_norm_eps)
        self.silu_and_mul(torch.ones(1, 2 * cfg.intermediate_size, dtype=dtype, device=device))
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)      # a kernel's fault surfaces here


def choose_fused_ops(cfg: ModelConfig, dtype: torch.dtype, device) -> tuple[TorchOps, str]:
    """(ops, why) for a Llama-family model of `cfg` in `dtype` on `device`."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return TORCH_OPS, f"torch's on {dev.type}"
    if dtype not in FUSED_DTYPES:
        return TORCH_OPS, (f"torch's: flashinfer's fused norm and SwiGLU have no "
                           f"{str(dtype).removeprefix('torch.')} kernels")
    try:
        import flashinfer
    except ImportError:
        return TORCH_OPS, "torch's: flashinfer is not installed (pip install 'pdserve[gpu]')"
    try:
        ops = FlashInferOps(flashinfer)
        ops.warm_up(cfg, dtype, dev)
    except Exception as e:      # the JIT build, the driver, a width the kernel refuses
        return TORCH_OPS, f"torch's: flashinfer's fused ops failed at load: " \
                          f"{type(e).__name__}: {e}"
    return ops, "flashinfer's fused_add_rmsnorm, rmsnorm and silu_and_mul"
