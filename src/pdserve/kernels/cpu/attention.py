"""Decode rows' attention by pdserve's own CPU kernel (cpu/attention.c,
built by native.py): what TorchAttention runs for a round's decode rows on
CPU where the kernels build.

torch's path for the same rows gathers every row's pages into a
contiguous, head-major copy and runs two batched matmuls with a softmax
between them: at eight rows of 256 tokens on a 2-core AVX2 host, about
2 ms a layer, a third of SmolLM2's decode round. The kernel reads each
key and value where it lies in the paged cache, once, in float32
arithmetic whatever the cache's dtype (as torch's path on CPU), and
writes the output rows.
"""

from __future__ import annotations

import ctypes

import torch

PAGE_DTYPES = (torch.float32, torch.bfloat16)


def fits(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """Whether the kernel takes these: a CPU cache of float32 or bfloat16
    pages [pages, page_size, kv_heads, head_dim] contiguous within a page
    (K and V alike), head_dim a multiple of 8."""
    inner = k_pages.shape[2] * k_pages.shape[3]
    return q.device.type == "cpu" and k_pages.dtype in PAGE_DTYPES \
        and v_pages.dtype == k_pages.dtype and k_pages.shape[3] % 8 == 0 \
        and k_pages.stride()[1:] == (inner, k_pages.shape[3], 1) \
        and v_pages.stride() == k_pages.stride()


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, k_pages: torch.Tensor,
                     v_pages: torch.Tensor, tables: torch.Tensor, base: torch.Tensor,
                     begin: torch.Tensor, end: torch.Tensor, scale: float,
                     softcap: float | None, threads: int = 0) -> torch.Tensor:
    """q [B, H, d] -> [B, H, d] in q's dtype. Row b attends positions
    begin[b] <= p < end[b]; `tables` [B, width] (int64) holds its pages from
    position base[b] on; `threads` as NativeMatmul's. The caller checks `fits`."""
    B, H, d = q.shape
    qf = q.float().contiguous()
    out = torch.empty(B, H, d)
    tables = tables.contiguous()
    rc = lib.pd_decode_attention(
        qf.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), int(k_pages.dtype == torch.bfloat16),
        k_pages.stride(0), k_pages.shape[1], k_pages.shape[2], d, H, tables.data_ptr(),
        tables.shape[1], base.data_ptr(), begin.data_ptr(), end.data_ptr(), B, scale,
        softcap or 0.0, out.data_ptr(), threads)
    if rc:
        raise MemoryError("pd_decode_attention could not allocate its scores")
    return out.to(q.dtype)
