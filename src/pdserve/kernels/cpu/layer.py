"""A round's rows through pdserve's own CPU layer (cpu/layer.c, built by
native.py): one C call a layer instead of DecoderModel's eager torch
calls, where the model's weights are kept quantized on a CPU with the
native kernels.

At one row a SmolLM2 decode step is mostly dispatch: about 60 torch calls
a layer (norms, the rotary roll, the cache write, dtype conversions, the
residual adds), each a few microseconds, around a few tens of microseconds
of matmul and attention. The C layer runs the same arithmetic on each row
on its own (cpu/matmul.c's products, cpu/attention.c's attention, the
small steps between them in plain loops), with the residual stream kept
in float32 between layers.

Every row takes it, a decode row, a verify row or a prefill chunk's: each
is a query at its position over its sequence's keys up to its own
(attention.row_spans; a chunk's K/V are written before any of its rows
attends), computed on its own. So a row's bits depend neither on what
shares its round nor on how its prompt was chunked.

A prompt's rows (a round's leading prefill rows) are multiplied more
precisely than decode rows, and their logits take the head's dense copy.
In a bfloat16 model on a CPU with AVX512-BF16 they multiply the weights'
bfloat16 copy in one pass (cpu/bf16.c, packed here at load). Elsewhere
they get about 15 bits of activation precision from two 8-bit passes: the
activations, then their rounding error (cpu/matmul.c's pd_linear_precise).
One 8-bit pass, as llama.cpp runs a prompt, changed SmolLM2's answer to
"What is the capital of France?" to llama.cpp's own ("L'Étoile, la
Marseillaise, ..."). Decode rows keep one pass, since their error is not
read back by every later token. At 160 rows one thread multiplies about
107 GMAC/s in bfloat16, against about 90 per 8-bit pass. A model it does
not fit (other layer kinds, LoRA enabled, dense weights,
PDSERVE_CPU_KERNELS=torch) never takes it, for any row.
`native_layers_for` says which, and why.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels.cpu import attention as cpu_attention
from pdserve.kernels.attention import BatchMeta, TorchAttention, row_spans
from pdserve.kernels.cpu.matmul import NativeMatmul
from pdserve.kernels.cpu.native import chosen_kernels
from pdserve.kernels.cpu.quantized import QuantizedLinear
from pdserve.kernels.models.rope import Rotary

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Matmul(ctypes.Structure):
    _fields_ = [("bits", _i64), ("n", _i64), ("rows", _i64), ("k", _i64), ("w", _ptr),
                ("scale", _ptr), ("zero", _ptr), ("dense", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matmul), ("o", _Matmul), ("gate_up", _Matmul), ("down", _Matmul),
                ("ln1", _ptr), ("ln2", _ptr), ("qkv_bias", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", _ptr), ("sin", _ptr)]


class _Round(ctypes.Structure):
    _fields_ = [("batch", _i64), ("precise", _i64), ("positions", _ptr), ("slots", _ptr),
                ("tables", _ptr), ("base", _ptr), ("begin", _ptr), ("end", _ptr),
                ("table_width", _i64), ("page_size", _i64), ("page_stride", _i64),
                ("bf16", ctypes.c_int)]


def _matmul(m: NativeMatmul, dense: torch.Tensor | None) -> _Matmul:
    return _Matmul(m.bits, m.n, m.rows, m.k, m.weights.data_ptr(), m.scale.data_ptr(),
                   m.zero.data_ptr(), dense.data_ptr() if dense is not None else None)


def native_layers_for(model) -> tuple[NativeLayers | None, str]:
    """The C layer for a DecoderModel, or None and why it does not fit."""
    c = model.cfg
    found = chosen_kernels()
    lib = found.lib
    why = []
    if lib is None:
        why.append(f"pdserve's kernels do not run here ({found.why})")
    if model.device.type != "cpu" or model.dtype not in cpu_attention.PAGE_DTYPES:
        why.append(f"the model runs on {model.device} in {model.dtype}")
    if model.tp is not None:
        why.append("tensor parallelism")
    attn = model.attention
    if type(attn) is not TorchAttention or attn.softcap is not None:
        why.append(f"attention is {type(attn).__name__}")
    if c.hidden_act != "silu" or c.partial_rotary_factor != 1.0 or c.head_dim % 8:
        why.append("the layer is not Llama's (silu, full rotary, head_dim a multiple of 8)")
    weights = [w for layer in model.layers for w in (layer[3], layer[5], layer[7], layer[8])]
    if not all(isinstance(w, QuantizedLinear) and w.native is not None for w in weights):
        why.append("not every projection is quantized for pdserve's matmul")
    if why or lib is None:
        return None, "; ".join(why)
    layers = NativeLayers(model, lib)
    return layers, ("pdserve's C layers, a prompt's rows in one bfloat16 pass" if
                    layers.prompt_bf16 else "pdserve's C layers, a prompt's rows in two 8-bit "
                    "passes")


class NativeLayers:
    """A DecoderModel's layers as the C layer reads them, built once."""

    def __init__(self, model, lib: ctypes.CDLL):
        c = model.cfg
        self.lib = lib
        rot = Rotary(c, torch.float32, "cpu")
        self.max_position = rot.cos.shape[0]
        self._keep: list[torch.Tensor] = [rot.cos, rot.sin]
        self.shape = _Model(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                            c.intermediate_size, c.rms_norm_eps, model.attention.scale,
                            rot.cos.data_ptr(), rot.sin.data_ptr())
        # a bfloat16 model's prompt rows multiply its bfloat16 weights where
        # the CPU can (cpu/bf16.c: each weight's dense copy, packed in place
        # of it); else two 8-bit passes
        self.prompt_bf16 = model.dtype == torch.bfloat16 and bool(lib.pd_has_bf16())
        self.layers = []
        for (_g, _j, ln1, qkv, bias, o, ln2, gate_up, down) in model.layers:
            f32 = [t.float().contiguous() for t in (ln1, ln2)] + \
                ([bias.float().contiguous()] if bias is not None else [])
            self._keep += f32
            mms = []
            for w in (qkv, o, gate_up, down):
                if self.prompt_bf16 and w.bf16 is None:
                    w.use_bf16(lib)
                mms.append(_matmul(w.native, w.bf16.weights if self.prompt_bf16 else None))
            self.layers.append(_Layer(*mms, f32[0].data_ptr(), f32[1].data_ptr(),
                                      f32[2].data_ptr() if bias is not None else None))

    def run(self, h: torch.Tensor, meta: BatchMeta, pages: list) -> torch.Tensor | None:
        """Every row's hidden state after every layer, float32 [T, hidden],
        from theirs before (`h`). `pages`: each layer's (k_pages, v_pages).
        None where the cache's layout is not the kernel's (then torch's path
        runs, for every round alike)."""
        k0, v0 = pages[0]
        if not cpu_attention.fits(h, k0, v0):
            return None
        tables, base, begin, end = row_spans(meta, k0.shape[1])
        positions = meta.positions.to(torch.long).contiguous()
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= self.max_position:     # the C layer reads the table unchecked
            raise IndexError(f"positions {lo}..{hi} are outside the model's 0.."
                             f"{self.max_position - 1}")
        slots = meta.slot_mapping.to(torch.long).contiguous()
        x = h.to(torch.float32, copy=True).contiguous()
        rows = x.shape[0]
        # a prompt's rows (first in row order) multiplied precisely (bfloat16 or two passes)
        rnd = _Round(rows, meta.prefill_rows(), positions.data_ptr(), slots.data_ptr(),
                     tables.data_ptr(), base.data_ptr(), begin.data_ptr(), end.data_ptr(),
                     tables.shape[1], k0.shape[1], k0.stride(0),
                     int(k0.dtype == torch.bfloat16))
        shape, at = ctypes.addressof(self.shape), ctypes.addressof(rnd)
        for layer, (k, v) in zip(self.layers, pages):
            if self.lib.pd_layer(shape, ctypes.addressof(layer), at, x.data_ptr(),
                                 k.data_ptr(), v.data_ptr(), 0):
                raise MemoryError(f"pd_layer could not allocate {rows} rows' scratch")
        return x
