"""A CPU stand-in for the two flashinfer wrappers pdserve calls, written from
flashinfer's documented contract (docs.flashinfer.ai, decode and prefill
APIs), not from pdserve's code: CSR page tables (indptr, indices,
last_page_len), NHD caches read by their strides, causal masks aligned to
the end of each request's keys, `window_left` keys to the left. Plain
per-request loops, float32 math.

It lets the CPU suite check what pdserve hands flashinfer (the plans, the
split between prefill and decode rows, the strided per-layer caches); the
kernels themselves are checked on CUDA by tests/kernels/test_device.py (`-m device`).

Also the fused elementwise ops, as `norm.rmsnorm`, `norm.fused_add_rmsnorm`
and `activation.silu_and_mul` (and at top level, where flashinfer exports
them too), from their docstrings and flashinfer's own reference
(tests/test_norm.py): float32 inside, rounded once to the input's dtype;
`fused_add_rmsnorm` in place, the residual rounded but the norm taken
over the float32 sum.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def _check_csr(indptr, indices, last, page_size):
    for t in (indptr, indices, last):
        assert t.dtype == torch.int32, f"flashinfer wants int32 page tables, got {t.dtype}"
    assert indptr[0] == 0 and bool((indptr[1:] >= indptr[:-1]).all())
    assert int(indptr[-1]) == indices.numel()
    assert bool(((last >= 1) & (last <= page_size)).all()), "1 <= last_page_len <= page_size"


# flashinfer ships half-precision (and fp8) kernels, none for float32; a test
# that wants exact float32 comparisons opens this, knowing the real one won't
DTYPES = [torch.float16, torch.bfloat16]


def _check_dtypes(q_data_type, kv_data_type):
    assert q_data_type in DTYPES, q_data_type
    assert kv_data_type is None or kv_data_type in DTYPES, kv_data_type


def _kv(cache, indices, page_size, last, i, indptr):
    pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
    k_cache, v_cache = cache
    # read by strides, but a row of head_dim must be dense and K, V alike
    assert k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.shape == v_cache.shape and k_cache.shape[1] == page_size
    n = (pages.numel() - 1) * page_size + int(last[i])
    k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n]
    v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n]
    return k.float(), v.float()


def _attend(q, k, v, qpos, window_left, scale):
    """q [Tq, H, d], k/v [L, KVH, d]; query at position qpos[j] sees keys
    qpos[j] - window_left .. qpos[j] (all to the left when window_left < 0)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    kpos = torch.arange(k.shape[0])
    allowed = kpos[None, :] <= qpos[:, None]
    if window_left >= 0:
        allowed &= kpos[None, :] >= qpos[:, None] - window_left
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


BACKENDS = ("auto", "fa2", "fa3", "cudnn", "trtllm-gen", "cute-dsl")


def _check_out(out, q):
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, *, backend="auto"):
        assert kv_layout == "NHD" and backend in BACKENDS
        self.backend = backend
        self.plans = 0
        self.planned_rows = []          # each plan's longest chunk (auto's fa2/fa3 switch)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False,
             window_left=-1, sm_scale=None, q_data_type=torch.float16,
             kv_data_type=None):
        _check_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        assert qo_indptr.dtype == torch.int32 and causal
        _check_dtypes(q_data_type, kv_data_type)
        self.args = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        self.shape = (num_qo_heads, num_kv_heads, head_dim_qk, page_size)
        self.window_left, self.q_dtype = window_left, q_data_type
        self.scale = sm_scale if sm_scale is not None else head_dim_qk ** -0.5
        self.plans += 1
        self.planned_rows.append(int((qo_indptr[1:] - qo_indptr[:-1]).max()))

    def run(self, q, paged_kv_cache, *, out=None):
        _check_out(out, q)
        given = out
        qo, indptr, indices, last = self.args
        h, kvh, d, ps = self.shape
        assert q.dtype == self.q_dtype and q.shape[1:] == (h, d)
        assert q.shape[0] == int(qo[-1]), "q rows must match the planned qo_indptr"
        out = torch.empty(q.shape, dtype=torch.float32)
        for i in range(qo.numel() - 1):
            rows = slice(int(qo[i]), int(qo[i + 1]))
            k, v = _kv(paged_kv_cache, indices, ps, last, i, indptr)
            assert k.shape[1:] == (kvh, d)
            t = rows.stop - rows.start
            qpos = torch.arange(k.shape[0] - t, k.shape[0])   # causal, bottom-right aligned
            out[rows] = _attend(q[rows], k, v, qpos, self.window_left, self.scale)
        return _result(out, q, given)


def _result(out, q, given):
    if given is None:
        return out.to(q.dtype)
    given.copy_(out)
    return given


class BatchDecodeWithPagedKVCacheWrapper:
    """With `use_cuda_graph` the batch size is fixed at the length of the
    last-page buffer; plan() refuses another batch size or more indices
    than the indices buffer holds, and copies the table into the three
    buffers; run() reads the buffers, as a replayed graph does, never
    plan's arguments."""

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto"):
        assert kv_layout == "NHD" and backend in BACKENDS
        self.backend, self.use_tensor_cores = backend, use_tensor_cores
        self.plans = 0
        self.graph = use_cuda_graph
        if use_cuda_graph:
            bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                    paged_kv_last_page_len_buffer)
            if not all(torch.is_tensor(b) for b in bufs):
                raise ValueError("cudagraph mode needs the three page-table buffers")
            if len(paged_kv_indptr_buffer) != len(paged_kv_last_page_len_buffer) + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
            self.buffers = bufs

    # flashinfer's decode plan takes its optional arguments by keyword only,
    # and refuses unknown ones: so does this one
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, window_left=-1, sm_scale=None, q_data_type=torch.float16,
             kv_data_type=None):
        _check_csr(indptr, indices, last_page_len, page_size)
        _check_dtypes(q_data_type, kv_data_type)
        self.args = (indptr, indices, last_page_len)
        if self.graph:
            ip, ix, lp = self.buffers
            if indptr.numel() - 1 != lp.numel():
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if indices.numel() > ix.numel():
                raise ValueError("The size of indices should be less than or equal to the "
                                 "allocated buffer")
            ip.copy_(indptr)
            lp.copy_(last_page_len)
            ix[:indices.numel()].copy_(indices)
            self.args = self.buffers
        self.shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self.window_left, self.q_dtype = window_left, q_data_type
        self.scale = sm_scale if sm_scale is not None else head_dim ** -0.5
        self.plans += 1

    def run(self, q, paged_kv_cache, *, out=None):
        _check_out(out, q)
        given = out
        indptr, indices, last = self.args
        h, kvh, d, ps = self.shape
        assert q.dtype == self.q_dtype and q.shape == (indptr.numel() - 1, h, d)
        out = torch.empty(q.shape, dtype=torch.float32)
        for i in range(q.shape[0]):
            k, v = _kv(paged_kv_cache, indices, ps, last, i, indptr)
            qpos = torch.tensor([k.shape[0] - 1])
            out[i] = _attend(q[i:i + 1], k, v, qpos, self.window_left, self.scale)[0]
        return _result(out, q, given)


# ---- flashinfer.norm and flashinfer.activation ---------------------------------

def _check_rows(x, weight=None):
    assert x.dtype in DTYPES, f"flashinfer's norm and activation kernels: no {x.dtype}"
    assert x.dim() == 2 and x.stride(-1) == 1, "rows [batch, hidden], the last dim dense"
    if weight is not None:
        # the kernel reads weight as the input's element type: no conversion
        assert weight.shape == (x.shape[1],) and weight.dtype == x.dtype, (weight.shape,
                                                                          weight.dtype)


def _rms(x32, weight, eps):
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    """out = input / RMS(input) * weight."""
    _check_rows(input, weight)
    y = _rms(input.float(), weight, eps).to(input.dtype)
    if out is None:
        return y
    assert out.shape == input.shape and out.dtype == input.dtype
    return out.copy_(y)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place, returning None: residual += input; input = residual /
    RMS(residual) * weight."""
    _check_rows(input, weight)
    assert residual.shape == input.shape and residual.dtype == input.dtype
    assert residual.stride(-1) == 1 and residual.data_ptr() != input.data_ptr()
    x = input.float() + residual.float()
    residual.copy_(x)
    input.copy_(_rms(x, weight, eps))


def silu_and_mul(input, out=None, enable_pdl=None):
    """silu(input[..., :d]) * input[..., d:], of input [..., 2d]."""
    assert input.dtype in DTYPES and input.stride(-1) == 1
    if input.shape[-1] * input.element_size() % 16 != 0:
        raise ValueError("The pointers must be multiple of 16 bytes.")
    d = input.shape[-1] // 2
    x = input.float()
    y = (F.silu(x[..., :d]) * x[..., d:]).to(input.dtype)
    if out is None:
        return y
    assert out.shape == y.shape and out.dtype == input.dtype
    return out.copy_(y)


norm = SimpleNamespace(rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm)
activation = SimpleNamespace(silu_and_mul=silu_and_mul)
