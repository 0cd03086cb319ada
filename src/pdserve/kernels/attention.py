"""Paged attention: K/V live in pages; each sequence reads its own through
a block table (the pages: kv_cache.py). Two backends behind one interface:
the torch reference here (CPU and CUDA) and flashinfer's paged wrappers
(flashinfer_attention.py, CUDA only). `choose_backend` (backends.py) says which one a
model gets and why; the loader logs it.

A round has one BatchMeta per cache group: the group's block tables, where
each row's K/V goes in the group's pages, and the group's window. A sliding
group's table has HOLE below the window; attention reads a sequence's pages
from its `kv_start` on, so it never touches them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu import attention as cpu_attention
from pdserve.kernels.cpu.native import chosen_kernels


@dataclass
class SeqMeta:
    q_start: int          # first row of this sequence in the flat batch
    q_len: int            # rows it computes this round
    ctx_len: int          # keys it attends over, these rows included
    block_table: list     # its pages, in order: entry i holds tokens [i*ps, (i+1)*ps)
    # The lowest key position its rows read. Slots below kv_start // ps are
    # never read (a sliding group's HOLEs); keys below kv_start are masked.
    # 0 for full history; a sliding group's oldest key of its first row's
    # window, or the first re-fed row when a replay regenerates the window.
    kv_start: int = 0


@dataclass
class BatchMeta:
    seqs: list            # SeqMeta, prefill chunks first, then decodes (q_len 1)
    # [T] page * page_size + offset for each row's K/V; -1 for a row whose
    # K/V this group does not keep (a replay row in a non-replayable group)
    slot_mapping: torch.Tensor
    positions: torch.Tensor      # [T]
    num_decodes: int = 0  # the trailing q_len == 1 sequences, batched together
    window: int | None = None    # keys a query sees, itself included; None: all before it
    # The rows whose K/V are written (ascending), when some slot is -1; None:
    # every row. Given by the caller: finding the -1s on a GPU would sync.
    write_rows: torch.Tensor | None = None
    # The speculative verify rows (a few rows each over a long history) just
    # before the decodes: the torch backend batches them as it does decodes;
    # other backends take them as prefill chunks, which they are too.
    num_verifies: int = 0
    # a backend's per-round inputs, shared by every layer: torch's a dict of
    # tensors; a captured flashinfer bucket's its CapturedDecode
    _prep: Any = None

    def prefill_rows(self) -> int:
        """The leading rows that belong to prefill chunks (every row before
        the first verify or decode)."""
        first = len(self.seqs) - self.num_decodes - self.num_verifies
        if first <= 0:                  # decodes and verifies only (or a captured round's)
            return 0
        if first >= len(self.seqs):
            return int(self.slot_mapping.shape[0])
        return self.seqs[first].q_start


def decode_spans(seqs: list, ps: int, window: int | None) -> tuple:
    """Decode (or verify) sequences' keys, on CPU: (tables [B, width] int64, each row's
    pages from its kv_start's page on, padded with its own first page;
    base [B], the position of a table's first slot; begin and end [B], the
    positions a row attends, begin <= p < end)."""
    lo = [s.kv_start // ps for s in seqs]
    n = [-(-s.ctx_len // ps) - a for s, a in zip(seqs, lo)]
    width = max(n)
    tables = torch.tensor([s.block_table[a:a + k] + [s.block_table[a]] * (width - k)
                           for s, a, k in zip(seqs, lo, n)], dtype=torch.long)
    end = torch.tensor([s.ctx_len for s in seqs], dtype=torch.long)
    base = torch.tensor(lo, dtype=torch.long) * ps
    begin = base if window is None else torch.maximum(base, end - window)
    return tables, base, begin, end


def page_csr(seqs: list, ps: int) -> tuple[list, list, list]:
    """Each sequence's pages from its kv_start's page on as a CSR page table,
    flashinfer's form (attention, its captured decode, MLA): indptr, the
    page indices, and how many slots of each sequence's last page it reads."""
    indptr, indices, last = [0], [], []
    for s in seqs:
        lo, n = s.kv_start // ps, -(-s.ctx_len // ps)
        indices.extend(s.block_table[lo:n])
        indptr.append(len(indices))
        last.append(s.ctx_len - (n - 1) * ps)
    return indptr, indices, last


def row_spans(meta: BatchMeta, ps: int) -> tuple:
    """decode_spans for every row of a round, each a query of its own: a
    prefill chunk's or a verify's row j attends its sequence's keys up to
    its own position (ctx_len - q_len + j), the chunk's earlier rows
    included, so their K/V must be written first. (tables [T, width],
    base, begin, end [T]); a decode row's are decode_spans' own."""
    seqs = meta.seqs
    rows = int(meta.slot_mapping.shape[0])
    q_len = torch.tensor([s.q_len for s in seqs], dtype=torch.long)
    if int(q_len.sum()) != rows or any(s.q_start != a for s, a in
                                       zip(seqs, [0, *q_len.cumsum(0)[:-1].tolist()])):
        raise ValueError("row_spans needs a round's sequences to cover its rows in order")
    tables, base, _, _ = decode_spans(seqs, ps, None)
    seq = torch.repeat_interleave(torch.arange(len(seqs)), q_len)
    first = torch.tensor([s.q_start for s in seqs], dtype=torch.long)
    past = torch.tensor([s.ctx_len - s.q_len for s in seqs], dtype=torch.long)
    end = past[seq] + torch.arange(rows) - first[seq] + 1
    begin = torch.maximum(base, torch.tensor([s.kv_start for s in seqs], dtype=torch.long))[seq]
    if meta.window is not None:
        begin = torch.maximum(begin, end - meta.window)
    return tables[seq], base[seq], begin, end


class TorchAttention:
    """Reference backend: exact, plain torch, any device. Each round's window
    is its BatchMeta's."""

    name = "torch"
    MATMUL_SCORES = 1 << 22   # a chunk with more scores than this goes to SDPA

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None, scale: float | None = None,
                 softcap: float | None = None):
        """`sliding_window`: the model's sliding layers' window, if it has
        any (flashinfer's warm_up compiles the windowed kernels for it).
        `scale`: the scores' factor (default head_dim ** -0.5); `softcap`:
        scores become softcap * tanh(scores / softcap) (Gemma's option)."""
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.window = sliding_window
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.softcap = softcap
        self._scratch_bufs: dict[str, torch.Tensor] = {}

    def _scratch(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A grow-only buffer reused by every layer and round. Decode's page
        gathers are megabytes a layer; freshly allocated, each one faults its
        pages in from the OS, which on CPU cost more than the copy itself
        (index_select of 32 x 8 pages: 568 µs fresh, 79 µs into a reused buffer)."""
        n = math.prod(shape)
        buf = self._scratch_bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            grown = n if buf is None else max(n, buf.numel() * 5 // 4)
            buf = self._scratch_bufs[name] = torch.empty(grown, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def _native_lib(self):
        """pdserve's CPU kernels for decode rows (kernels/cpu/native.py), looked
        up on the first CPU decode: the library, or None to keep torch's path."""
        if not hasattr(self, "_native"):
            self._native = chosen_kernels().lib
        return self._native

    def plan(self, meta: BatchMeta, k_pages: torch.Tensor, dtype) -> None:
        """Prepare the round now (forward's first layer does it otherwise)."""
        self._prepare(meta, k_pages.shape[1], k_pages.device)

    def warm_up(self, dtype: torch.dtype, device, page_size: int = 16) -> list[str]:
        """Nothing to compile: torch's kernels ship built."""
        return []

    def _prepare(self, meta: BatchMeta, ps: int, device) -> dict:
        """What every layer of the group shares this round: where each row's
        K/V goes, each prefill's page table (from its kv_start's page) and
        mask, the decode batch's padded tables and mask. Built once a round
        (the group's first layer), not per layer."""
        if getattr(meta, "_prep", None) is not None:
            return meta._prep  # type: ignore[return-value]
        slots, rows = meta.slot_mapping, meta.write_rows
        if rows is not None:
            slots = slots[rows]
        prep: dict = {"page": slots // ps, "off": slots % ps, "rows": rows, "pre": []}
        window = meta.window
        n_pre = len(meta.seqs) - meta.num_decodes
        n_chunks = n_pre - meta.num_verifies
        if meta.num_verifies:
            prep["ver"] = self._prepare_verifies(meta.seqs[n_chunks:n_pre], ps, window, device)
        for s in meta.seqs[:n_chunks]:
            lo = s.kv_start // ps
            table = torch.as_tensor(s.block_table[lo: -(-s.ctx_len // ps)], device=device)
            qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=device)
            kpos = torch.arange(lo * ps, s.ctx_len, device=device)
            mask = kpos[None, :] <= qpos[:, None]
            if window is not None:
                mask &= kpos[None, :] > qpos[:, None] - window
            if s.kv_start > lo * ps:
                mask &= kpos[None, :] >= s.kv_start
            prep["pre"].append((s, lo * ps, table, mask))  # type: ignore[union-attr]
        if meta.num_decodes:
            seqs = meta.seqs[n_pre:]
            tables, base, begin, ctx = decode_spans(seqs, ps, window)
            ctx_d = ctx.to(device)
            kpos = torch.arange(tables.shape[1] * ps, device=device)[None, :] + \
                base.to(device)[:, None]
            mask = kpos < ctx_d[:, None]
            if window is not None:
                mask &= kpos > (ctx_d[:, None] - 1 - window)
            # an additive float32 mask: 0 where a key counts, -inf past the end
            bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
            prep["dec"] = (seqs[0].q_start, len(seqs), tables.to(device), bias[:, None, None, :])  # type: ignore[assignment]
            if device.type == "cpu":
                # the same keys as spans, for pdserve's kernel (cpu/attention.py)
                prep["dec_span"] = (base, begin, ctx)  # type: ignore[assignment]
        meta._prep = prep
        return prep

    @staticmethod
    def _prepare_verifies(seqs, ps: int, window, device) -> tuple:
        """Verify rows as one batch: each sequence's query rows padded to the
        longest (a pad repeats its last row, and its output is dropped), its
        pages padded as a decode's are, and a causal mask per query row."""
        M = max(s.q_len for s in seqs)
        tables, base, _, _ = decode_spans(seqs, ps, None)
        qrows = [s.q_start + min(j, s.q_len - 1) for s in seqs for j in range(M)]
        qpos = torch.tensor([[s.ctx_len - s.q_len + min(j, s.q_len - 1) for j in range(M)]
                             for s in seqs], device=device)
        kpos = torch.arange(tables.shape[1] * ps, device=device)[None, :] + \
            base.to(device)[:, None]
        mask = kpos[:, None, :] <= qpos[:, :, None]                 # [B, M, L]
        if window is not None:
            mask &= kpos[:, None, :] > qpos[:, :, None] - window
        bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
        keep = [b * M + j for b, s in enumerate(seqs) for j in range(s.q_len)]
        out_rows = [s.q_start + j for s in seqs for j in range(s.q_len)]
        return (M, torch.tensor(qrows, device=device), tables.to(device),
                bias[:, None, None], torch.tensor(keep, device=device),
                torch.tensor(out_rows, device=device))

    def _verify(self, q, k_pages, v_pages, ver) -> tuple:
        """The verify rows' attention: (their rows, their output), as
        `_decode` computes a decode's, M query rows a sequence."""
        M, qrows, tables, bias, keep, out_rows = ver
        B, ps = tables.shape[0], k_pages.shape[1]
        L = tables.shape[1] * ps
        flat = tables.view(-1)
        keys, vals = (pages.index_select(0, flat).view(B, L, self.kvh, self.d)
                      .transpose(1, 2).contiguous() for pages in (k_pages, v_pages))
        g = self.group
        qg = q.index_select(0, qrows).view(B, M, self.kvh, g, self.d) \
            .permute(0, 2, 3, 1, 4).reshape(B, self.kvh, g * M, self.d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.view(B, self.kvh, g, M, L) + bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(B, self.kvh, g * M, L)
        o = torch.matmul(probs, vals).view(B, self.kvh, g, M, self.d)
        o = o.permute(0, 3, 1, 2, 4).reshape(B * M, self.h, self.d)
        return out_rows, o.index_select(0, keep)

    @staticmethod
    def _write(k, v, k_pages, v_pages, page, off, rows) -> None:
        if rows is None:
            k_pages[page, off] = k
            v_pages[page, off] = v
        else:
            k_pages[page, off] = k[rows]
            v_pages[page, off] = v[rows]

    def forward(self, q, k, v, k_pages, v_pages, meta: BatchMeta) -> torch.Tensor:
        """q: [T, H, d]; k, v: [T, KVH, d]. Writes k, v into the pages, then
        attends. Returns [T, H, d]."""
        ps = k_pages.shape[1]
        prep = self._prepare(meta, ps, q.device)
        self._write(k, v, k_pages, v_pages, prep["page"], prep["off"], prep["rows"])
        out = torch.empty_like(q)
        gqa = self.group > 1
        for s, first, table, mask in prep["pre"]:
            rows = slice(s.q_start, s.q_start + s.q_len)
            n = s.ctx_len - first
            if s.ctx_len == s.q_len:       # a first chunk: its keys are its own rows
                keys, vals = k[rows], v[rows]
            else:
                keys = k_pages.index_select(0, table).reshape(-1, self.kvh, self.d)[:n]
                vals = v_pages.index_select(0, table).reshape(-1, self.kvh, self.d)[:n]
            if self.h * s.q_len * n <= self.MATMUL_SCORES or self.softcap is not None:
                out[rows] = self._prefill(q[rows], keys, vals, mask)
            else:                          # SDPA tiles the scores: bounded memory
                o = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                    attn_mask=mask, scale=self.scale, enable_gqa=gqa)
                out[rows] = o.transpose(0, 1)
        if "ver" in prep:
            rows_v, o = self._verify(q, k_pages, v_pages, prep["ver"])
            out.index_copy_(0, rows_v, o)
        if "dec" in prep:
            first, B, tables, bias = prep["dec"]
            rows = slice(first, first + B)
            lib = self._native_lib() if "dec_span" in prep else None
            if lib is not None and cpu_attention.fits(q, k_pages, v_pages) and \
                    not torch.compiler.is_compiling():
                base, begin, end = prep["dec_span"]
                out[rows] = cpu_attention.decode_attention(
                    lib, q[rows], k_pages, v_pages, tables, base, begin, end, self.scale,
                    self.softcap)
            else:
                out[rows] = self._decode(q[rows], k_pages, v_pages, tables, bias)
        return out

    def _prefill(self, q, keys, vals, mask):
        """One chunk's attention as two matmuls, the scores ([H, T, L]) held
        whole: on CPU faster than SDPA's masked path, most in bfloat16."""
        T, L = q.shape[0], keys.shape[0]
        g = self.group
        qg = q.view(T, self.kvh, g, self.d).permute(1, 2, 0, 3)
        keys = keys.transpose(0, 1).contiguous()               # [kvh, L, d]
        vals = vals.transpose(0, 1).contiguous()
        scores = torch.matmul(qg.reshape(self.kvh, g * T, self.d), keys.transpose(1, 2))
        scores = (scores.float() * self.scale).view(self.kvh, g, T, L)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores.masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype).view(self.kvh, g * T, L)
        o = torch.matmul(probs, vals).view(self.kvh, g, T, self.d)
        return o.permute(2, 0, 1, 3).reshape(T, self.h, self.d)

    def _decode(self, q, k_pages, v_pages, tables, bias):
        """One query row per sequence, as two batched matmuls with the softmax
        in float32 between them. The query heads sharing a KV head go in one
        matmul. On CPU this is faster than SDPA's masked path in float32 and
        ~10x faster in bfloat16, whose SDPA has no fast masked kernel there.

        On CPU both matmuls run in float32 whatever the cache's dtype (the
        gather's head-major copy converts as it copies): torch's bfloat16
        bmm at a decode's shapes (a few query rows over a few hundred keys)
        cost about twice float32's, SmolLM2's 60 a step 2 ms of a 17 ms
        step. The choice is the device's, never the batch's, so a row's
        result does not depend on the rows beside it."""
        B, ps = tables.shape[0], k_pages.shape[1]
        L = tables.shape[1] * ps
        flat = tables.view(-1)
        acc = torch.float32 if q.device.type == "cpu" else q.dtype
        heads = []
        for name, pages in (("k", k_pages), ("v", v_pages)):
            if torch.compiler.is_compiling():   # traced: the compiler plans its own buffers
                gathered = pages.index_select(0, flat).view(B, L, self.kvh, self.d)
                heads.append(gathered.transpose(1, 2).to(acc).contiguous())
                continue
            rows = self._scratch("rows", (flat.numel(),) + pages.shape[1:], pages.dtype,
                                 pages.device)
            torch.index_select(pages, 0, flat, out=rows)
            # head-major and contiguous: matmul on the transposed gather is ~3x slower
            hm = self._scratch(name, (B, self.kvh, L, self.d), acc, pages.device)
            heads.append(hm.copy_(rows.view(B, L, self.kvh, self.d).transpose(1, 2)))
        keys, vals = heads
        qg = q.reshape(B, self.kvh, self.group, self.d).to(acc)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + bias
        probs = torch.softmax(scores, dim=-1).to(acc)
        return torch.matmul(probs, vals).to(q.dtype).reshape(B, self.h, self.d)
