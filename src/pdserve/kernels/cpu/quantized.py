"""A GGUF's quantized weights kept quantized on CPU (`model.quantization:
auto` where the kernels run, or `gguf`): the linear layers multiply 4- or
8-bit weights directly in decode steps instead of a dense copy dequantized
at load.

A decode step of a small model on CPU is bound by reading its weights:
SmolLM2-135M's layers are 0.27 GB in bfloat16 and 0.08 GB as the file's
Q4_1 blocks. Two sets of kernels multiply them:

- pdserve's own (kernels/cpu/matmul.py, AVX2), wherever they build: the
  file's blocks as stored, times each row quantized to 8-bit blocks of 32,
  in integers, as llama.cpp does. On a 2-core AVX2 host a SmolLM2 decode
  round costs about 0.7x torch's kernels' at one row and 0.8x at eight;
  with a Llama-family model's rows in one C call a layer (cpu/layer.py),
  0.38x and 0.48x on an AVX-512 host (`pdserve bench quantized`).
- torch's weight-only kernels otherwise (no AVX2, no C compiler, or
  PDSERVE_CPU_KERNELS=torch), from bfloat16 rows:
  `_weight_int4pack_mm_for_cpu` for 4 bits, groups of 32 along the input,
  each with a scale and a zero, w = (q - 8) * scale + zero (a Q4_1 block,
  w = q * d + m, is such a group with zero = m + 8d; a Q4_0 block, w = (q -
  8) * d, with zero = 0), and `_weight_int8pack_mm` for 8 bits (`Q8_0`, the
  tied embedding and LM head of SmolLM2), one scale per output row, so
  Q8_0's per-block values are requantized per row.

Both cost more per row than a dense matmul once a round has many rows, so
a QuantizedLinear also keeps the weights dequantized (in the model's dtype,
bfloat16 or float32) and splits a round by the kind of row, never by the
round's size: the leading rows of prefill chunks (`dense_rows`, hundreds
of rows a chunk) multiply the dense copy, and decode and verify rows (a
few per request) the kernels. A decode row therefore goes through the same
kernel whether it runs alone, beside other decodes or beside a prefill
chunk, and the kernels compute each row on its own (tests/kernels/models/test_gguf.py
holds a row's bits alone and batched); with the dense copy's products in
an order pdserve's kernels fix (`dense_product`: cpu/dense.c or
cpu/bf16.c, never torch's BLAS where they run), a request's tokens do not
depend on the batch it runs in. One exception: a position's K/V computed
by a decode row (the kernels) and recomputed by a prefill (the dense copy)
differ by the quantization's rounding, so a prefix hit on generated
tokens, a retracted request's recompute or the disk tier can lead to other
tokens than an uninterrupted run. The cost is memory: the dense copy plus the
packed weights (a quarter of a bfloat16 copy for 4 bits, half for 8).
Where a model's rows run pdserve's C layers (cpu/layer.py) every row,
prompts included, takes the packed weights there, and the dense copy serves
only a prompt's logits rows through the head; in a bfloat16 model on a CPU
with AVX512-BF16 a layer weight's dense copy is packed for cpu/bf16.c in its
place (`use_bf16`), for its prompt rows.

`QuantizedTensor` is the file's values as read (integers, per-group scale
and zero), which the loader can permute and concatenate like a tensor
(Q and K rows back in Hugging Face order, q k v and gate up fused);
`QuantizedLinear` packs one for the kernels at model build.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.cpu.matmul import Bf16Matmul, NativeMatmul, dense_product, fits_dense
from pdserve.kernels.cpu.features import cpu_flags
from pdserve.kernels.cpu.native import chosen_kernels

GROUP = 32                     # elements per GGUF block, and per kernel group
KINDS = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class QuantizedTensor:
    """A [rows, cols] weight as integers `q` with, per group of GROUP
    columns, `scale` and `zero` ([rows, cols / GROUP] each, float32):
    w = q * scale + zero. `bits`: 4 (q in 0..15) or 8 (q in -127..127)."""
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """float32 values, what gguf's dequantize gives."""
        rows, cols = self.q.shape
        w = self.q.float().view(rows, cols // GROUP, GROUP) * self.scale[..., None] \
            + self.zero[..., None]
        return w.view(rows, cols)

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows `index` in that order (a permutation, or a slice as a range)."""
        return QuantizedTensor(self.q[index], self.scale[index], self.zero[index], self.bits)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Stacked by rows (q k v into one matmul), as torch.cat would."""
        if len({p.bits for p in parts}) != 1:
            raise ValueError("cannot fuse weights quantized to different widths: "
                             f"{[p.bits for p in parts]} bits")
        return QuantizedTensor(torch.cat([p.q for p in parts]),
                               torch.cat([p.scale for p in parts]),
                               torch.cat([p.zero for p in parts]), parts[0].bits)


def from_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> QuantizedTensor:
    """A GGUF tensor's bytes (`kind` one of KINDS) as a QuantizedTensor."""
    if cols % GROUP:
        raise ValueError(f"{kind} tensor with {cols} columns: not whole blocks of {GROUP}")
    width = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // GROUP, width)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = b[..., 2:].copy().view(np.int8).astype(np.int16)
        return QuantizedTensor(torch.from_numpy(q.reshape(rows, cols)), torch.from_numpy(d),
                               torch.zeros(rows, cols // GROUP), 8)
    start = 4 if kind == "Q4_1" else 2
    qs = b[..., start:]
    # element j of a block is the low nibble of byte j, element j + 16 the high one
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    if kind == "Q4_1":
        zero = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        zero = -8.0 * d
    return QuantizedTensor(torch.from_numpy(q.reshape(rows, cols)), torch.from_numpy(d),
                           torch.from_numpy(np.ascontiguousarray(zero)), 4)


def kernels_present() -> bool:
    """Whether this torch has the CPU weight-only kernels."""
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch, "_convert_weight_to_int4pack_for_cpu") and \
        hasattr(torch, "_weight_int8pack_mm")


DTYPES = (torch.bfloat16, torch.float32)     # the model dtypes a QuantizedLinear serves
# torch's kernels' fast path takes bfloat16 inputs: given float32 ones, torch
# 2.13 runs a reference loop about 20x slower (measured on an AVX2 CPU), so
# a float32 model's rows are rounded to bfloat16 on the way in to them.
KERNEL_DTYPE = torch.bfloat16


class QuantizedLinear:
    """y = x @ w.T for a QuantizedTensor w, packed once for the CPU kernels
    (`native`: pdserve's, where they run; else torch's for its width), and
    dequantized to `dtype` for a round's leading prefill rows. Inputs and
    outputs are [rows, in] and [rows, out] of `dtype` (bfloat16 or
    float32)."""

    def __init__(self, t: QuantizedTensor, dtype: torch.dtype):
        if dtype not in DTYPES:
            raise ValueError(f"quantized matmuls run in bfloat16 or float32, not {dtype}")
        self.out_features, self.in_features = t.shape
        self.bits = t.bits
        self.dense: torch.Tensor | None = t.dequantize().to(dtype)
        self.bf16: Bf16Matmul | None = None     # the dense copy packed (use_bf16)
        lib = chosen_kernels().lib
        # pdserve's own kernels where they run (kernels/cpu/matmul.py), else torch's
        self.native = NativeMatmul(t.q, t.scale, t.zero, t.bits, lib) if lib else None
        if self.native is not None:
            return
        if t.bits == 4:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(t.q.to(torch.int32), 1)
            # [groups, rows, 2]: the kernel's w = (q - 8) * scale + zero
            self.scales = torch.stack([t.scale.t(), (t.zero + 8 * t.scale).t()], -1) \
                .to(KERNEL_DTYPE).contiguous()
        else:
            w = t.dequantize()
            scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
            self.packed = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.scales = scale.to(KERNEL_DTYPE)

    def __call__(self, x: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        """The first `dense_rows` rows (prefill chunks) through the dense
        copy, the rest (decodes, verifies) through the kernel."""
        if dense_rows >= x.shape[0]:
            return self.dense_product(x)
        if dense_rows == 0:
            return self.kernel(x)
        return torch.cat([self.dense_product(x[:dense_rows]), self.kernel(x[dense_rows:])])

    def use_bf16(self, lib) -> Bf16Matmul:
        """Pack the (bfloat16) dense copy for cpu/bf16.c and drop it: the
        rows that took the copy multiply the packed one instead, so the
        weight keeps one bfloat16 copy (cpu/layer.py reads it too)."""
        assert self.dense is not None and self.dense.dtype == torch.bfloat16
        assert self.native is not None
        self.bf16 = Bf16Matmul(self.dense, self.native.rows, lib)
        self.dense = None
        return self.bf16

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ dense.T, each row computed on its own wherever pdserve's
        kernels run: the packed bfloat16 copy through cpu/bf16.c
        (use_bf16), else the dense copy through cpu/dense.c, both summing
        every output in an order they fix. torch's BLAS picks its kernel
        by the row count (on an Intel CPU with AMX a float32 row among 1
        to 15 rows had other last bits than among 40, however padded), so
        it serves only where pdserve's kernels do not run, and there a
        row's bits may depend on its round (`prompt_path` says which)."""
        if self.bf16 is not None:
            return self.bf16(x).to(x.dtype)
        assert self.dense is not None
        if self.native is not None and fits_dense(self.dense):
            return dense_product(x, self.dense, self.native.lib).to(x.dtype)
        return torch.nn.functional.linear(x, self.dense)

    def prompt_path(self) -> str:
        """Who multiplies this weight's prompt rows, for the load's log."""
        if self.bf16 is not None:
            return "one bfloat16 pass in pdserve's order (cpu/bf16.c)"
        if self.native is not None and self.dense is not None and fits_dense(self.dense):
            return f"{_name(self.dense.dtype)} in pdserve's order (cpu/dense.c)"
        return "torch's BLAS (a row's bits may depend on its round)"

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """Every row through the quantized kernel, in x's dtype: the native
        one (from float32 rows, on native.share_cores' threads) or torch's
        (from bfloat16 rows)."""
        if self.native is not None:
            return self.native(x.float()).to(x.dtype)
        xk = x.to(KERNEL_DTYPE)
        if self.bits == 4:
            y = torch._weight_int4pack_mm_for_cpu(xk, self.packed, GROUP, self.scales)
        else:
            y = torch._weight_int8pack_mm(xk, self.packed, self.scales)
        return y.to(x.dtype)

    def nbytes(self) -> int:
        """The packed weights' bytes (the dense copy aside)."""
        if self.native is not None:
            return self.native.nbytes()
        return self.packed.numel() * self.packed.element_size() + \
            self.scales.numel() * self.scales.element_size()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantized_linears(model) -> list[QuantizedLinear]:
    """A model's QuantizedLinear layers (what tests and benchmarks inspect)."""
    found = [w for layer in getattr(model, "layers", []) for w in layer
             if isinstance(w, QuantizedLinear)]
    return found + ([model.lm_head] if isinstance(model.lm_head, QuantizedLinear) else [])


def row_paths(model) -> str:
    """Who multiplies a quantized model's prompt rows and their logits, for
    the load's log: pdserve's fixed-order kernels (a row's bits its own)
    or torch's BLAS; and, on a CPU with AMX tiles, that they are unused."""
    layers = [w for w in quantized_linears(model) if w is not model.lm_head]
    native = getattr(model, "native_layers", None)
    if native is not None:
        prompt = "one bfloat16 pass in pdserve's order (cpu/bf16.c)" if native.prompt_bf16 \
            else "two 8-bit passes in pdserve's order (cpu/matmul.c)"
    else:
        prompt = layers[0].prompt_path() if layers else "dense weights, torch's BLAS"
    head = model.lm_head.prompt_path() if isinstance(model.lm_head, QuantizedLinear) \
        else "dense weights, torch's BLAS"
    said = f"prompt rows: {prompt}; their logits: {head}"
    if "amx_bf16" in cpu_flags():
        said += "; this CPU has AMX tiles (amx_bf16), which pdserve's kernels do not use"
    return said


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None,
           dense_rows: int = 0) -> torch.Tensor:
    """F.linear, or a QuantizedLinear's matmul (plus `bias`), its first
    `dense_rows` rows (a round's prefill chunks) through the dense copy."""
    if isinstance(w, QuantizedLinear):
        y = w(x, dense_rows)
        return y if bias is None else y + bias
    return torch.nn.functional.linear(x, w, bias)


def dense(t, dtype: torch.dtype, device) -> torch.Tensor:
    """A weight as a plain tensor (dequantized if it is a QuantizedTensor)."""
    if isinstance(t, QuantizedTensor):
        t = t.dequantize()
    return t.to(dtype=dtype, device=device)


def packed(t: QuantizedTensor, dtype: torch.dtype, device) -> QuantizedLinear:
    if torch.device(device).type != "cpu":
        raise ValueError("quantized GGUF weights run on CPU only; on a GPU use "
                         "model.quantization: none (the weights dequantized)")
    return QuantizedLinear(t, dtype)


def fuse(parts: list, dtype: torch.dtype, device):
    """Weights that share one matmul (q k v; gate up), stacked by rows:
    quantized if every part is quantized to the same width, else dense."""
    if all(isinstance(p, QuantizedTensor) for p in parts) and \
            len({p.bits for p in parts}) == 1:
        return packed(QuantizedTensor.cat(parts), dtype, device)
    return torch.cat([dense(p, dtype, device) for p in parts])


def choose_quantization(quantization: str, file_kinds: str | None, device, dtype: torch.dtype,
                        tp_size: int = 1, arch: str = "llama") -> tuple[bool, str]:
    """(keep the GGUF's quantized weights, why). `file_kinds`: the file's
    quantized tensor types (ModelConfig.quantization; None for float
    weights or a checkpoint directory). `auto` keeps them wherever the
    kernels can run (a decode step reads a quarter of the bytes, and the
    split by kind of row keeps tokens independent of the batch) and
    otherwise dequantizes, saying why; `gguf` asks for them and fails on
    what prevents it; `none` dequantizes. `arch`: the model's family
    (only the Llama family's layers run quantized)."""
    kinds = [k for k in (file_kinds or "").split(", ") if k]
    kept = [k for k in kinds if k in KINDS]
    if quantization == "none":
        return False, "model.quantization is none"
    blockers = []
    if not kept:
        blockers.append("the checkpoint has no Q4_0, Q4_1 or Q8_0 tensors"
                        + (f" (it has {', '.join(kinds)})" if kinds else ""))
    if torch.device(device).type != "cpu":
        blockers.append(f"the model runs on {device}, and the kernels are CPU ones")
    if dtype not in DTYPES:
        blockers.append(f"dtype is {str(dtype).removeprefix('torch.')}, and quantized layers "
                        "serve bfloat16 or float32 models (model.dtype: auto, bfloat16 or "
                        "float32)")
    if tp_size > 1:
        blockers.append(f"tensor_parallel_size is {tp_size} (the shards are dequantized)")
    if arch != "llama":
        blockers.append(f"the model is {arch}, and quantized layers serve the Llama family")
    # pdserve's kernels (built here on first use), else torch's
    native = chosen_kernels() if kept and torch.device(device).type == "cpu" else None
    if native is not None and native.lib is None and not kernels_present():
        blockers.append(f"pdserve's kernels do not run here ({native.why}) and this torch "
                        "lacks _weight_int4pack_mm_for_cpu")
    kernels = "pdserve's AVX2 kernels" if native and native.lib else \
        f"torch's int4/int8 kernels; pdserve's do not run here: {native.why}" if native else ""
    how = (f"{', '.join(kept)} tensors multiplied quantized ({kernels}) for decode rows, "
           "a dense copy for prefill rows outside pdserve's C layers")
    if quantization == "auto":
        if not kept:
            return False, "auto: no tensors to keep quantized"
        if blockers:
            return False, "auto: dequantized, since " + "; ".join(blockers)
        return True, f"auto: {how}"
    if blockers:
        raise ValueError("model.quantization: gguf cannot keep the weights quantized: "
                         + "; ".join(blockers) + "; use model.quantization: none or auto")
    return True, f"model.quantization is gguf: {how}"
