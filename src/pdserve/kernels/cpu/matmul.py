"""A GGUF's Q4_0, Q4_1 and Q8_0 blocks multiplied by pdserve's own CPU
kernel (cpu/matmul.c, built by native.py): what a QuantizedLinear's decode
rows run where the kernels build.

torch's weight-only kernels (`_weight_int4pack_mm_for_cpu`) dequantize the
weights to floats as they go: on a 2-core AVX2 host they read SmolLM2's
4-bit layers at about 2 GB/s. This kernel does what llama.cpp does
instead: each activation row is quantized to blocks of 32 bytes with one
scale, and a block's product is an integer dot product of bytes (AVX2's
vpmaddubsw), scaled once. The weights keep the file's blocks exactly (a
Q8_0 LM head too, which torch's int8 kernel needs requantized per row).
"""

from __future__ import annotations

import ctypes

import torch

GROUP = 32            # the C file's block size
COLS = 8              # the C file's weight group: output rows are padded to a multiple


def _grouped(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, blocks, ...] padded to `rows` and laid out [rows / COLS, blocks, COLS, ...]."""
    n = t.shape[0]
    if rows > n:
        t = torch.cat([t, t.new_zeros(rows - n, *t.shape[1:])])
    return t.view(rows // COLS, COLS, *t.shape[1:]).transpose(1, 2).contiguous()


class NativeMatmul:
    """A QuantizedTensor's blocks laid out for pd_linear. `__call__(x)`:
    float32 [m, k] -> float32 [m, n]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                 lib: ctypes.CDLL):
        n, k = q.shape
        if k % GROUP:
            raise ValueError(f"{k} columns are not whole blocks of {GROUP}")
        self.lib, self.bits, self.n, self.k = lib, bits, n, k
        self.rows = -(-n // COLS) * COLS
        blocks = q.view(n, k // GROUP, GROUP)
        if bits == 4:      # the GGUF's byte e: weight e in the low nibble, e + 16 the high
            packed = (blocks[..., :16] | (blocks[..., 16:] << 4)).to(torch.uint8)
        else:
            packed = blocks.to(torch.int8)
        # [groups, blocks, 8 columns, bytes] -> [groups, blocks, bytes / 4, 8 columns, 4]:
        # each 32 bytes one vector, lane c four of column c's bytes
        g = _grouped(packed, self.rows)
        self.weights = g.view(*g.shape[:3], -1, 4).transpose(2, 3).contiguous()
        self.scale = _grouped(scale.float(), self.rows)
        self.zero = _grouped(zero.float(), self.rows)

    def __call__(self, x: torch.Tensor, threads: int = 0) -> torch.Tensor:
        """x [m, k] float32 -> [m, n] float32; `threads`: at most this many of
        the kernels' workers share it (0: all, native.share_cores)."""
        x = x.contiguous()
        if x.dtype != torch.float32:
            raise TypeError(f"the native kernels take float32 rows, not {x.dtype}")
        m = x.shape[0]
        y = torch.empty(m, self.rows)
        if m and self.lib.pd_linear(self.bits, x.data_ptr(), m, self.k, self.weights.data_ptr(),
                                    self.scale.data_ptr(), self.zero.data_ptr(), self.rows,
                                    y.data_ptr(), threads):
            raise MemoryError(f"pd_linear could not allocate {m} rows' scratch")
        return y if self.rows == self.n else y[:, :self.n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weights, self.scale, self.zero))


def pack_bf16(dense: torch.Tensor, rows: int) -> torch.Tensor:
    """A weight's dense copy [n, k] as cpu/bf16.c's pd_linear_bf16 reads it:
    bfloat16, n padded with zero rows to `rows` (a multiple of COLS),
    [rows / COLS][k / 2][COLS][2]."""
    n, k = dense.shape
    w = torch.zeros(rows, k, dtype=torch.bfloat16)
    w[:n] = dense
    return w.view(rows // COLS, COLS, k // 2, 2).transpose(1, 2).contiguous()


class Bf16Matmul:
    """A bfloat16 weight [n, k] packed for pd_linear_bf16 (`weights`, `rows`
    output rows, n padded to a multiple of COLS). `__call__(x)`: [m, k] ->
    float32 [m, n], x rounded to bfloat16 on the way in. Needs a CPU with
    AVX512-BF16 (the library's pd_has_bf16)."""

    def __init__(self, dense: torch.Tensor, rows: int, lib: ctypes.CDLL):
        self.lib, self.n, self.k, self.rows = lib, dense.shape[0], dense.shape[1], rows
        self.weights = pack_bf16(dense, rows)

    def __call__(self, x: torch.Tensor, threads: int = 0) -> torch.Tensor:
        x = x.to(torch.float32).contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.rows)
        if m and self.lib.pd_linear_bf16(x.data_ptr(), m, self.k, self.weights.data_ptr(),
                                         self.rows, y.data_ptr(), threads):
            raise MemoryError(f"pd_linear_bf16 could not take {m} rows (scratch, or no "
                              "AVX512-BF16)")
        return y if self.rows == self.n else y[:, :self.n]


DENSE_DTYPES = (torch.float32, torch.bfloat16)     # the weights pd_linear_dense reads


def fits_dense(w: torch.Tensor) -> bool:
    """Whether pd_linear_dense takes this weight: float32 or bfloat16 on
    CPU, its inputs a multiple of 8."""
    return w.device.type == "cpu" and w.dtype in DENSE_DTYPES and w.dim() == 2 and \
        w.shape[1] % 8 == 0


def dense_product(x: torch.Tensor, w: torch.Tensor, lib: ctypes.CDLL,
                  threads: int = 0) -> torch.Tensor:
    """x [m, k] @ w.T for a dense weight w [n, k] (float32 or bfloat16, as
    stored), float32 [m, n], by cpu/dense.c: each output summed in the
    order the file fixes, so a row's bits do not depend on the rows beside
    it, on the threads, or on the CPU (AVX2 and FMA only). x is taken as
    float32 (bfloat16 rows widen exactly)."""
    if not fits_dense(w):
        raise ValueError(f"pd_linear_dense takes a float32 or bfloat16 [n, k] CPU weight with "
                         f"k a multiple of 8, not {w.dtype} {tuple(w.shape)} on {w.device}")
    x = x.to(torch.float32).contiguous()
    w = w.contiguous()
    m, n = x.shape[0], w.shape[0]
    y = torch.empty(m, n)
    if m and lib.pd_linear_dense(x.data_ptr(), m, x.shape[1], w.data_ptr(),
                                 int(w.dtype == torch.bfloat16), n, y.data_ptr(), threads):
        raise ValueError(f"pd_linear_dense refused {m} rows of {x.shape[1]} inputs")
    return y
