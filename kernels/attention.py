"""Paged attention: K/V live in pages; each sequence reads its own through
a block table. Two backends behind one interface: a torch reference (CPU and
CUDA) and flashinfer's paged wrappers (CUDA only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqMeta:
    q_start: int          # first row of this sequence in the flat batch
    q_len: int            # rows it computes this round
    ctx_len: int          # keys it attends over, these rows included
    block_table: list     # its pages, in order


@dataclass
class BatchMeta:
    seqs: list            # SeqMeta, prefill chunks first, then decodes (q_len 1)
    slot_mapping: torch.Tensor   # [T] page * page_size + offset for each row's K/V
    positions: torch.Tensor      # [T]
    num_decodes: int = 0  # the trailing q_len == 1 sequences, batched together


class KVCache:
    """One page-major tensor for every layer's K and V:
    [pages, layers, 2, page_size, kv_heads, head_dim]. A page is one
    contiguous region, so moving a run of pages (to host, or to a peer over
    NIXL) is one copy or one descriptor; a layer's K (or V) is a strided view
    [pages, page_size, kv_heads, head_dim]."""

    def __init__(self, layers, pages, page_size, kv_heads, head_dim, dtype, device):
        self.page_size = page_size
        self.data = torch.zeros(pages, layers, 2, page_size, kv_heads, head_dim,
                                dtype=dtype, device=device)

    def layer(self, i):
        return self.data[:, i, 0], self.data[:, i, 1]


class TorchAttention:
    """Reference backend: exact, plain torch, any device."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None):
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.window = sliding_window
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v, k_pages, v_pages, meta: BatchMeta) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, KVH, d]. Writes k, v into the pages, then
        attends. Returns [T, H, d]."""
        ps = k_pages.shape[1]
        page, off = meta.slot_mapping // ps, meta.slot_mapping % ps
        k_pages[page, off] = k
        v_pages[page, off] = v
        out = torch.empty_like(q)
        n_pre = len(meta.seqs) - meta.num_decodes
        for s in meta.seqs[:n_pre]:
            out[s.q_start:s.q_start + s.q_len] = self._prefill(q, k_pages, v_pages, s, ps)
        if meta.num_decodes:
            dec = meta.seqs[n_pre:]
            first = dec[0].q_start
            out[first:first + len(dec)] = self._decode(q[first:first + len(dec)], k_pages,
                                                       v_pages, dec, ps)
        return out

    def _gather(self, pages, table, ctx):
        return pages[table].reshape(-1, self.kvh, self.d)[:ctx]

    def _prefill(self, q, k_pages, v_pages, s: SeqMeta, ps: int):
        table = torch.as_tensor(s.block_table[: -(-s.ctx_len // ps)], device=q.device)
        keys = self._gather(k_pages, table, s.ctx_len)
        vals = self._gather(v_pages, table, s.ctx_len)
        qs = q[s.q_start:s.q_start + s.q_len]
        qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device)
        kpos = torch.arange(s.ctx_len, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if self.window is not None:
            mask &= kpos[None, :] > qpos[:, None] - self.window
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
            attn_mask=mask, scale=self.scale, enable_gqa=self.group > 1)
        return o.transpose(0, 1)

    def _decode(self, q, k_pages, v_pages, seqs, ps: int):
        B = len(seqs)
        max_pages = max(-(-s.ctx_len // ps) for s in seqs)
        tables = torch.zeros(B, max_pages, dtype=torch.long)
        ctx = torch.empty(B, dtype=torch.long)
        for i, s in enumerate(seqs):
            n = -(-s.ctx_len // ps)
            tables[i, :n] = torch.as_tensor(s.block_table[:n])
            ctx[i] = s.ctx_len
        tables, ctx = tables.to(q.device), ctx.to(q.device)
        keys = k_pages[tables].reshape(B, max_pages * ps, self.kvh, self.d)
        vals = v_pages[tables].reshape(B, max_pages * ps, self.kvh, self.d)
        kpos = torch.arange(max_pages * ps, device=q.device)
        mask = kpos[None, :] < ctx[:, None]
        if self.window is not None:
            mask &= kpos[None, :] > (ctx[:, None] - 1 - self.window)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=self.group > 1)
        return o.squeeze(2)


class FlashInferAttention(TorchAttention):
    """flashinfer's paged prefill and decode wrappers (CUDA). K/V writes are
    the reference backend's; attention reads the pages in place through
    CSR page tables, planned once a round and reused by every layer."""

    name = "flashinfer"
    WORKSPACE_BYTES = 128 * 1024 * 1024

    def __init__(self, num_heads, num_kv_heads, head_dim, sliding_window=None):
        import flashinfer  # raises ImportError where it is absent

        super().__init__(num_heads, num_kv_heads, head_dim, sliding_window)
        self._fi = flashinfer
        self._ws = None
        self._planned = None            # the BatchMeta the wrappers are planned for

    def _wrappers(self, device):
        if self._ws is None:
            self._ws = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._prefill_w = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._ws, "NHD")
            self._decode_w = self._fi.BatchDecodeWithPagedKVCacheWrapper(self._ws, "NHD")

    @staticmethod
    def _csr(seqs, ps: int, device):
        indptr, indices, last = [0], [], []
        for s in seqs:
            n = -(-s.ctx_len // ps)
            indices.extend(s.block_table[:n])
            indptr.append(len(indices))
            last.append(s.ctx_len - (n - 1) * ps)
        i32 = dict(dtype=torch.int32, device=device)
        return torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32)

    def _plan(self, meta: BatchMeta, ps: int, dtype, device) -> None:
        self._wrappers(device)
        n_pre = len(meta.seqs) - meta.num_decodes
        window = (self.window - 1) if self.window else -1
        if n_pre:
            pre = meta.seqs[:n_pre]
            qo = torch.tensor([0] + [s.q_start + s.q_len for s in pre], dtype=torch.int32,
                              device=device)
            indptr, indices, last = self._csr(pre, ps, device)
            self._prefill_w.plan(qo, indptr, indices, last, self.h, self.kvh, self.d, ps,
                                 causal=True, window_left=window, sm_scale=self.scale,
                                 q_data_type=dtype, kv_data_type=dtype)
        if meta.num_decodes:
            indptr, indices, last = self._csr(meta.seqs[n_pre:], ps, device)
            self._decode_w.plan(indptr, indices, last, self.h, self.kvh, self.d, ps,
                                window_left=window, sm_scale=self.scale, q_data_type=dtype,
                                kv_data_type=dtype)
        self._planned = meta

    def forward(self, q, k, v, k_pages, v_pages, meta: BatchMeta) -> torch.Tensor:
        ps = k_pages.shape[1]
        page, off = meta.slot_mapping // ps, meta.slot_mapping % ps
        k_pages[page, off] = k
        v_pages[page, off] = v
        if self._planned is not meta:
            self._plan(meta, ps, q.dtype, q.device)
        out = torch.empty_like(q)
        n_pre = len(meta.seqs) - meta.num_decodes
        split = meta.seqs[n_pre].q_start if meta.num_decodes else q.shape[0]
        if n_pre:
            out[:split] = self._prefill_w.run(q[:split], (k_pages, v_pages))
        if meta.num_decodes:
            out[split:] = self._decode_w.run(q[split:], (k_pages, v_pages))
        return out


def make_backend(name: str, device, **kw):
    """'auto' picks flashinfer on CUDA when it is installed, else torch."""
    if name == "flashinfer" or (name == "auto" and torch.device(device).type == "cuda"):
        try:
            return FlashInferAttention(**kw)
        except ImportError:
            if name == "flashinfer":
                raise ValueError("attention backend 'flashinfer' needs the gpu extra: "
                                 "pip install 'pdserve[gpu]' on a CUDA machine") from None
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}; use auto, torch or flashinfer")
    return TorchAttention(**kw)
