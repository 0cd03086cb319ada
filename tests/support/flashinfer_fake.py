"""A CPU stand-in for the two flashinfer wrappers pdserve calls, written from
flashinfer's documented contract (docs.flashinfer.ai, decode and prefill
APIs), not from pdserve's code: CSR page tables (indptr, indices,
last_page_len), NHD caches read by their strides, causal masks aligned to
the end of each request's keys, `window_left` keys to the left. Plain
per-request loops, float32 math.

It lets the CPU suite check what pdserve hands flashinfer (the plans, the
split between prefill and decode rows, the strided per-layer caches); the
kernels themselves are checked on CUDA by tests/kernels/test_device.py (`-m device`).

And `mla.BatchMLAPagedAttentionWrapper` (also at top level), from
flashinfer 0.7.4's docstrings and signatures (flashinfer/mla/_batch_mla/):
the canonical keyword form, `plan(metadata=mla.MLAPlanMetadata.csr(...),
...)` and `run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), out=...)`, its
metadata checks, the kernels' outer-strides-only reads in 16-byte vectors,
and the fa2/fa3 widths (head_dim_ckv a multiple of 128, head_dim_kpe of
64); the output is in latent space, the sum over ckv.

Also the fused elementwise ops, as `norm.rmsnorm`, `norm.fused_add_rmsnorm`
and `activation.silu_and_mul` (and at top level, where flashinfer exports
them too), from their docstrings and flashinfer's own reference
(tests/test_norm.py): float32 inside, rounded once to the input's dtype;
`fused_add_rmsnorm` in place, the residual rounded but the norm taken
over the float32 sum.
"""

from __future__ import annotations

from dataclasses import dataclass
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


# ---- flashinfer.mla: the planned MLA wrapper (0.7.4) -----------------------------

@dataclass(frozen=True)
class MLAPlanMetadata:
    """Canonical CSR metadata (the dense form is not stood in for)."""
    qo_indptr: torch.Tensor | None = None
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    kv_len_arr: torch.Tensor | None = None

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


MLA_BACKENDS = ("auto", "autotune", "fa2", "fa3", "cutlass", "cutile", "trtllm-gen", "xqa",
                "cute-dsl", "cute-dsl-monolithic", "cute-dsl-modular", "cute-dsl-rubin-mtp")


def _check_mla_metadata(m, page_size):
    """flashinfer's _validate_csr_metadata: rank-1 contiguous int32 on the
    host or the device, indptrs from 0 and nondecreasing, one batch size,
    each request's page count ceil(kv_len / page_size)."""
    assert isinstance(m, MLAPlanMetadata), "metadata must be an MLAPlanMetadata instance"
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"):
        t = getattr(m, name)
        assert torch.is_tensor(t) and t.dim() == 1 and t.is_contiguous(), name
        assert t.dtype == torch.int32, f"{name} metadata must have dtype torch.int32"
    for t in (m.qo_indptr, m.kv_indptr):
        assert int(t[0]) == 0 and bool((t[1:] >= t[:-1]).all())
    b = m.qo_indptr.numel() - 1
    assert m.kv_indptr.numel() == b + 1 and m.kv_len_arr.numel() == b, "batch dims must agree"
    assert int(m.kv_indptr[-1]) <= m.kv_indices.numel()
    assert bool((m.kv_len_arr >= 0).all())
    pages = (m.kv_len_arr.long() + page_size - 1) // page_size
    assert torch.equal(pages, (m.kv_indptr[1:] - m.kv_indptr[:-1]).long()), \
        "CSR metadata page counts in kv_indptr must equal ceil(kv_len_arr / page_size)"


def _vector_reads(t):
    """The fa kernels take only a tensor's two outer strides and move 16
    bytes at a time: the last dim dense, the start and outer strides
    16-byte aligned."""
    assert t.dim() == 3 and t.stride(-1) == 1, "the last dim must be dense"
    assert t.data_ptr() % 16 == 0, "16-byte aligned"
    assert all(t.shape[a] == 1 or t.stride(a) * t.element_size() % 16 == 0 for a in (0, 1))


def _split(value, layout, widths, name):
    """A structural value as (no-PE, PE) tensors, as the plan's layout
    says: "split" an exact 2-tuple, "packed" one tensor joining them."""
    if layout == "split":
        assert type(value) is tuple and len(value) == 2, f"split {name} is an exact 2-tuple"
        left, right = value
    else:
        assert torch.is_tensor(value) and value.shape[-1] == sum(widths), f"packed {name}"
        left, right = value[..., :widths[0]], value[..., widths[0]:]
    assert left.dim() == right.dim() == 3 and left.shape[:-1] == right.shape[:-1], name
    assert (left.shape[-1], right.shape[-1]) == widths, f"{name} widths {widths}"
    return left, right


class BatchMLAPagedAttentionWrapper:
    """Absorbed MLA over paged caches: per request, query rows
    qo_indptr[i]:qo_indptr[i+1] against the first kv_len_arr[i] tokens of
    pages kv_indices[kv_indptr[i]:kv_indptr[i+1]]; a score is q_nope . ckv
    + q_pe . kpe times sm_scale; causal aligns the queries to the end of
    the keys; the output is the softmax's sum over ckv, [rows, heads,
    head_dim_ckv]. Positional arguments are deprecated in 0.7.4: refused."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
        assert backend in MLA_BACKENDS, backend
        assert not use_cuda_graph, "the stand-in has no CUDA-graph mode"
        self.backend = backend
        self.plans = 0
        self.planned = []               # each plan's metadata

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
             sm_scale, q_data_type, kv_data_type, query_layout="packed",
             kv_cache_layout="packed", lse_mode="none", output_dtype=None):
        _check_mla_metadata(metadata, page_size)
        _check_dtypes(q_data_type, kv_data_type)
        assert kv_data_type == q_data_type, "a non-FP8 KV dtype must match the query's"
        assert output_dtype in (None, q_data_type) and lse_mode == "none"
        assert head_dim_ckv % 128 == 0 and head_dim_kpe % 64 == 0, \
            "fa2/fa3 need head_dim_ckv a multiple of 128 and head_dim_kpe of 64"
        assert query_layout in ("packed", "split") and kv_cache_layout in ("packed", "split")
        self.m, self.heads, self.widths = metadata, num_heads, (head_dim_ckv, head_dim_kpe)
        self.ps, self.causal, self.scale, self.dtype = page_size, causal, sm_scale, q_data_type
        self.layouts = (query_layout, kv_cache_layout)
        self.plans += 1
        self.planned.append(metadata)

    def run(self, *, query, kv_cache, out=None):
        m, (ckv_w, _) = self.m, self.widths
        q_nope, q_pe = _split(query, self.layouts[0], self.widths, "query")
        ckv, kpe = _split(kv_cache, self.layouts[1], self.widths, "KV cache")
        for t in (q_nope, q_pe, ckv, kpe):
            assert t.dtype == self.dtype, (t.dtype, self.dtype)
            _vector_reads(t)
        assert q_nope.shape[:2] == (int(m.qo_indptr[-1]), self.heads), "the planned query shape"
        assert ckv.shape[1] == self.ps, "ckv_cache page size must match the planned page_size"
        if m.kv_indices.numel():
            assert ckv.shape[0] > int(m.kv_indices[:int(m.kv_indptr[-1])].max()), \
                "KV cache does not cover the planned CSR page indices"
        if out is None:
            out = torch.empty_like(q_nope)
        assert out.shape == q_nope.shape and out.dtype == q_nope.dtype
        for i in range(m.kv_len_arr.numel()):
            rows = slice(int(m.qo_indptr[i]), int(m.qo_indptr[i + 1]))
            pages = m.kv_indices[int(m.kv_indptr[i]):int(m.kv_indptr[i + 1])].long()
            n = int(m.kv_len_arr[i])
            k_lat = ckv[pages].reshape(-1, ckv_w)[:n].float()
            k_pe = kpe[pages].reshape(-1, kpe.shape[-1])[:n].float()
            scores = (torch.einsum("qhd,kd->hqk", q_nope[rows].float(), k_lat)
                      + torch.einsum("qhd,kd->hqk", q_pe[rows].float(), k_pe)) * self.scale
            t = rows.stop - rows.start
            if self.causal:             # query j sits at key position n - t + j
                qpos = torch.arange(n - t, n)
                scores = scores.masked_fill(torch.arange(n)[None, :] > qpos[:, None],
                                            float("-inf"))
            out[rows] = torch.einsum("hqk,kd->qhd", torch.softmax(scores, dim=-1),
                                     k_lat).to(out.dtype)
        return out


mla = SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper,
                      MLAPlanMetadata=MLAPlanMetadata)
