"""The Triton kernels of the fused batched LoRA (`kernels/lora/fused.py`
launches them): the shrink, x @ A[slot] into a float32 buffer, and the
expand, buffer @ B[slot] added into y, each over a grid of (row tile x
column tile, segment). Imports triton; nothing else in pdserve does.

They call only Triton's builtins (no `tl.cdiv` or `tl.zeros`: those are
`@triton.jit` helpers of triton's own, which the interpreter cannot call
when triton was imported before TRITON_INTERPRET was set, as in a test
process), and are jitted on first use, so the interpreter's setting is
read then, not at import.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import triton
import triton.language as tl


@lru_cache(maxsize=2)
def kernels(interpret: bool) -> tuple[Any, Any]:
    """(shrink, expand), jitted, or wrapped for the interpreter as
    `triton.jit` does when TRITON_INTERPRET=1 (`interpret`: that setting,
    one cache entry each)."""
    return triton.jit(_shrink_kernel), triton.jit(_expand_kernel)


def _shrink_kernel(x_ptr, a_ptr, s_ptr, rows_ptr, starts_ptr, lens_ptr, slots_ptr,
                   K, N, stride_xm, stride_as, stride_ak, stride_sm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   FP32: tl.constexpr):
    """s[row, n] = sum_k x[row, k] * A[slot, k, n] for one segment's rows."""
    seg = tl.program_id(1)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    tile_m, tile_n = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
    length = tl.load(lens_ptr + seg)
    if tile_m * BLOCK_M >= length:
        return
    start = tl.load(starts_ptr + seg)
    slot = tl.load(slots_ptr + seg)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs_m < length
    rows = tl.load(rows_ptr + start + offs_m, mask=in_m, other=0)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=in_m[:, None] & in_k[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_k[:, None] * stride_ak + offs_n[None, :],
                    mask=in_k[:, None] & in_n[None, :], other=0.0)
        if FP32:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    tl.store(s_ptr + rows[:, None] * stride_sm + offs_n[None, :], acc,
             mask=in_m[:, None] & in_n[None, :])


def _expand_kernel(s_ptr, b_ptr, y_ptr, rows_ptr, starts_ptr, lens_ptr, slots_ptr,
                   N, R, s_col, y_col, stride_sm, stride_bs, stride_br, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   FP32: tl.constexpr):
    """y[row, y_col + n] += sum_r s[row, s_col + r] * B[slot, r, n] for one
    segment's rows."""
    seg = tl.program_id(1)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    tile_m, tile_n = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
    length = tl.load(lens_ptr + seg)
    if tile_m * BLOCK_M >= length:
        return
    start = tl.load(starts_ptr + seg)
    slot = tl.load(slots_ptr + seg)
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_m = offs_m < length
    rows = tl.load(rows_ptr + start + offs_m, mask=in_m, other=0)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    in_r = offs_r < R
    s = tl.load(s_ptr + rows[:, None] * stride_sm + s_col + offs_r[None, :],
                mask=in_m[:, None] & in_r[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                mask=in_r[:, None] & in_n[None, :], other=0.0)
    if FP32:
        d = tl.dot(s, b, input_precision="ieee")
    else:
        d = tl.dot(s.to(b.dtype), b)
    out = y_ptr + rows[:, None] * stride_ym + y_col + offs_n[None, :]
    keep = in_m[:, None] & in_n[None, :]
    y = tl.load(out, mask=keep, other=0.0)
    tl.store(out, (y.to(tl.float32) + d).to(y.dtype), mask=keep)
