"""Paged attention: K/V live in pages; each sequence reads its own through
a block table. Two backends behind one interface: a torch reference (CPU and
CUDA) and flashinfer's paged wrappers (CUDA only). `choose_backend` says
which one a model gets and why; the loader logs it.

A round has one BatchMeta per cache group: the group's block tables, where
each row's K/V goes in the group's pages, and the group's window. A sliding
group's table has HOLE below the window; attention reads a sequence's pages
from its `kv_start` on, so it never touches them."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.model_config import ModelError


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
    _prep: dict | None = None    # a backend's per-round tensors, shared by every layer


class KVCache:
    """One page-major tensor for every layer's K and V:
    [pages, layers, 2, page_size, kv_heads, head_dim]. A page is one
    contiguous region, so moving a run of pages (to host, or to a peer over
    NIXL) is one copy or one descriptor; a layer's K (or V) is a strided view
    [pages, page_size, kv_heads, head_dim]."""

    def __init__(self, layers, pages, page_size, kv_heads, head_dim, dtype, device,
                 pin_memory: bool = False):
        """`pin_memory`: a host cache page-locked for a GPU's DMA (see
        `_pin`); pages are then not zeroed, as a device pool's fresh pages
        are not read before they are written."""
        self.page_size = page_size
        shape = (pages, layers, 2, page_size, kv_heads, head_dim)
        if pin_memory:
            self.data = torch.empty(shape, dtype=dtype)
            self._pin()
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=device)

    def _pin(self) -> None:
        """Page-lock `data` in place with cudaHostRegister. torch's
        pin_memory=True allocates through its caching host allocator, which
        rounds every block up to a power of two: a 117 GiB host cache would
        lock (and zero) 128 GiB. A plain allocation registered as it is locks
        exactly its own bytes; it is unregistered when this cache goes."""
        nbytes = self.data.numel() * self.data.element_size()
        if not nbytes:
            return
        cudart = torch.cuda.cudart()
        ptr = self.data.data_ptr()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(
                f"could not page-lock the {nbytes / 2 ** 30:.1f} GiB host KV cache "
                f"(cudaHostRegister: {err}); lower engine.host_pages, or raise the "
                "locked-memory limit (ulimit -l)")
        weakref.finalize(self, cudart.cudaHostUnregister, ptr)

    def layer(self, i):
        return self.data[:, i, 0], self.data[:, i, 1]

    def copy_pages_from(self, src: "KVCache", src_pages, dst_pages) -> None:
        """This cache's `dst_pages[i]` = `src`'s `src_pages[i]`: one copy per
        run of pages consecutive on both sides. Between a GPU pool and a
        pinned host cache each copy is a DMA queued on the current stream
        (non_blocking) and nothing waits: the caller synchronizes once,
        before it reports the copies done. Stream order already puts them
        before any later kernel that touches the same pages."""
        for s0, d0, n in _runs(src_pages, dst_pages):
            self.data[d0:d0 + n].copy_(src.data[s0:s0 + n], non_blocking=True)


def _runs(src, dst) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) where both sides run consecutively."""
    runs = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


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

    def _scratch(self, name: str, shape, like: torch.Tensor) -> torch.Tensor:
        """A grow-only buffer reused by every layer and round. Decode's page
        gathers are megabytes a layer; freshly allocated, each one faults its
        pages in from the OS, which on CPU cost more than the copy itself
        (index_select of 32 x 8 pages: 568 µs fresh, 79 µs into a reused buffer)."""
        n = math.prod(shape)
        buf = self._scratch_bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            grown = n if buf is None else max(n, buf.numel() * 5 // 4)
            buf = self._scratch_bufs[name] = torch.empty(grown, dtype=like.dtype,
                                                          device=like.device)
        return buf[:n].view(shape)

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
            return meta._prep
        slots, rows = meta.slot_mapping, meta.write_rows
        if rows is not None:
            slots = slots[rows]
        prep = {"page": slots // ps, "off": slots % ps, "rows": rows, "pre": []}
        window = meta.window
        n_pre = len(meta.seqs) - meta.num_decodes
        for s in meta.seqs[:n_pre]:
            lo = s.kv_start // ps
            table = torch.as_tensor(s.block_table[lo: -(-s.ctx_len // ps)], device=device)
            qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=device)
            kpos = torch.arange(lo * ps, s.ctx_len, device=device)
            mask = kpos[None, :] <= qpos[:, None]
            if window is not None:
                mask &= kpos[None, :] > qpos[:, None] - window
            if s.kv_start > lo * ps:
                mask &= kpos[None, :] >= s.kv_start
            prep["pre"].append((s, lo * ps, table, mask))
        if meta.num_decodes:
            seqs = meta.seqs[n_pre:]
            lo = [s.kv_start // ps for s in seqs]
            n = [-(-s.ctx_len // ps) - a for s, a in zip(seqs, lo)]
            width = max(n)
            # padded with the sequence's own first page: masked, but a page it holds
            tables = torch.tensor([s.block_table[a:a + k] + [s.block_table[a]] * (width - k)
                                   for s, a, k in zip(seqs, lo, n)], dtype=torch.long)
            ctx = torch.tensor([s.ctx_len for s in seqs], device=device)
            kpos = torch.arange(width * ps, device=device)[None, :]
            if any(lo):
                kpos = kpos + torch.tensor(lo, device=device)[:, None] * ps
            mask = kpos < ctx[:, None]
            if window is not None:
                mask &= kpos > (ctx[:, None] - 1 - window)
            # an additive float32 mask: 0 where a key counts, -inf past the end
            bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
            prep["dec"] = (seqs[0].q_start, len(seqs), tables.to(device), bias[:, None, None, :])
        meta._prep = prep
        return prep

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
        if "dec" in prep:
            first, B, tables, bias = prep["dec"]
            out[first:first + B] = self._decode(q[first:first + B], k_pages, v_pages, tables,
                                                bias)
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
        ~10x faster in bfloat16, whose SDPA has no fast masked kernel there."""
        B, ps = tables.shape[0], k_pages.shape[1]
        L = tables.shape[1] * ps
        flat = tables.view(-1)
        heads = []
        for name, pages in (("k", k_pages), ("v", v_pages)):
            rows = self._scratch("rows", (flat.numel(),) + pages.shape[1:], pages)
            torch.index_select(pages, 0, flat, out=rows)
            # head-major and contiguous: matmul on the transposed gather is ~3x slower
            hm = self._scratch(name, (B, self.kvh, L, self.d), pages)
            heads.append(hm.copy_(rows.view(B, L, self.kvh, self.d).transpose(1, 2)))
        keys, vals = heads
        qg = q.reshape(B, self.kvh, self.group, self.d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores + bias
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vals).reshape(B, self.h, self.d)


class FlashInferAttention(TorchAttention):
    """flashinfer's paged prefill and decode wrappers (CUDA). K/V writes are
    the reference backend's; attention reads the pages in place through
    CSR page tables, planned once a round per cache group and reused by each
    of the group's layers. A layer's K and V are strided views of the
    page-major pool (the page stride spans every layer); flashinfer reads
    caches by their strides since its non-contiguous KV cache support
    (flashinfer PR #513, 0.2).

    A sliding group's sequences hand flashinfer their pages from kv_start's
    on, with window_left = W - 1: flashinfer aligns the queries to the end
    of the keys it is given, so dropping whole pages from the front changes
    no relative position. It has no lower bound other than the window, so a
    kv_start inside the window (a replayed window) must fall on a page
    boundary; elsewhere `attention: torch` serves it."""

    name = "flashinfer"
    WORKSPACE_BYTES = 128 * 1024 * 1024
    # The prefill wrapper is pinned to fa2 rather than "auto". On Hopper,
    # auto re-picks the kernel family at every plan: fa3 when the round's
    # longest chunk has more than 64 rows, else fa2; on Blackwell it may pick
    # cuDNN, which needs packages we do not install. flashinfer compiles each
    # family on first use, fa3's SM90 CUTLASS units for minutes, so under auto
    # a compile lands mid-serving the first time a long prompt is chunked, and
    # a request's kernel (and its rounding) depends on its neighbours'
    # lengths. With fa2 one prefill module serves every chunk (and the
    # tensor-core decode, whose auto resolves to fa2 for half precision), and
    # `warm_up` compiles it at load. fa3 is faster on long chunks on H100/H200;
    # to take it set this to "auto": warm_up's >64-row chunk compiles it too.
    BACKEND = "fa2"
    WARM_ROWS = 65                      # one row more than auto's fa2 limit

    def __init__(self, num_heads, num_kv_heads, head_dim, sliding_window=None, scale=None,
                 softcap=None):
        import flashinfer  # raises ImportError where it is absent

        super().__init__(num_heads, num_kv_heads, head_dim, sliding_window, scale, softcap)
        self._fi = flashinfer
        self._ws = None
        # per window (None: full history): the group's wrappers and the round
        # they are planned for; groups differ in window, so it names the group
        self._groups: dict = {}

    def _wrappers(self, window, device) -> "_Planned":
        st = self._groups.get(window)
        if st is None:
            if self._ws is None:
                # zeroed: the decode wrapper asks for a zeroed workspace on first use.
                # One float workspace for every wrapper: their runs are stream-ordered,
                # and each keeps its plan in its own int workspace.
                self._ws = torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            # tensor cores past group 4, as SGLang and vLLM choose; flashinfer
            # has CUDA-core decode kernels for groups 1, 2, 3, 4, 6, 8 and 16
            st = self._groups[window] = _Planned(
                self._fi.BatchPrefillWithPagedKVCacheWrapper(self._ws, "NHD",
                                                             backend=self.BACKEND),
                self._fi.BatchDecodeWithPagedKVCacheWrapper(self._ws, "NHD",
                                                            use_tensor_cores=self.group > 4))
        return st

    @staticmethod
    def _csr(seqs, ps: int, window):
        """Host tensors: plan() reads indptr and last_page_len on the host and
        copies what the kernels need to the device itself, so tables built on
        the GPU would cost a device-to-host sync every round."""
        indptr, indices, last = [0], [], []
        for s in seqs:
            lo, n = s.kv_start // ps, -(-s.ctx_len // ps)
            if s.kv_start % ps and (window is None or
                                    s.kv_start > s.ctx_len - s.q_len - window + 1):
                raise ModelError(
                    f"flashinfer cannot start a sequence's keys mid-page (position "
                    f"{s.kv_start}, page size {ps}) inside its window: a replay that "
                    "re-feeds a window not aligned to pages; use attention: torch, or a "
                    "window and replay that are multiples of the page size")
            indices.extend(s.block_table[lo:n])
            indptr.append(len(indices))
            last.append(s.ctx_len - (n - 1) * ps)
        i32 = dict(dtype=torch.int32)
        return torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32)

    def _window_left(self, meta: BatchMeta) -> int:
        """flashinfer's window: keys to the left of the query (-1: all)."""
        return meta.window - 1 if meta.window is not None else -1

    def _plan(self, meta: BatchMeta, ps: int, dtype, device) -> "_Planned":
        st = self._wrappers(meta.window, device)
        n_pre = len(meta.seqs) - meta.num_decodes
        kw = dict(window_left=self._window_left(meta), sm_scale=self.scale,
                  q_data_type=dtype, kv_data_type=dtype)
        if self.softcap is not None:       # passed only when set: a stand-in need not know it
            kw["logits_soft_cap"] = self.softcap
        if n_pre:
            pre = meta.seqs[:n_pre]
            qo = torch.tensor([0] + [s.q_start + s.q_len for s in pre], dtype=torch.int32)
            indptr, indices, last = self._csr(pre, ps, meta.window)
            st.prefill.plan(qo, indptr, indices, last, self.h, self.kvh, self.d, ps,
                            causal=True, **kw)
        if meta.num_decodes:
            indptr, indices, last = self._csr(meta.seqs[n_pre:], ps, meta.window)
            st.decode.plan(indptr, indices, last, self.h, self.kvh, self.d, ps, **kw)
        slots, rows = meta.slot_mapping, meta.write_rows
        if rows is not None:
            slots = slots[rows]
        st.slots = (slots // ps, slots % ps, rows)
        st.meta = meta
        return st

    def plan(self, meta: BatchMeta, k_pages: torch.Tensor, dtype) -> None:
        """Plan the group's round now (its first layer does it otherwise)."""
        self._plan(meta, k_pages.shape[1], dtype, k_pages.device)

    def forward(self, q, k, v, k_pages, v_pages, meta: BatchMeta) -> torch.Tensor:
        st = self._groups.get(meta.window)
        if st is None or st.meta is not meta:
            st = self._plan(meta, k_pages.shape[1], q.dtype, q.device)
        self._write(k, v, k_pages, v_pages, *st.slots)
        q = q.contiguous()                 # a slice of the fused q/k rotation
        out = torch.empty_like(q)
        n_pre = len(meta.seqs) - meta.num_decodes
        split = meta.seqs[n_pre].q_start if meta.num_decodes else q.shape[0]
        if n_pre:
            st.prefill.run(q[:split], (k_pages, v_pages), out=out[:split])
        if meta.num_decodes:
            st.decode.run(q[split:], (k_pages, v_pages), out=out[split:])
        return out

    # the full-history group's wrappers (the only group of most models)
    @property
    def _prefill_w(self):
        return self._groups[None].prefill

    @property
    def _decode_w(self):
        return self._groups[None].decode

    @property
    def _planned(self):
        """The BatchMeta some group is planned for (None: none is)."""
        return next((st.meta for st in self._groups.values() if st.meta is not None), None)

    def warm_up(self, dtype: torch.dtype, device, page_size: int = 16) -> list[str]:
        """Plan and run every kernel the engine will use, on a scratch cache:
        a 1-row prefill, a WARM_ROWS-row prefill, a decode, and a round with
        both; without a window, and with the model's sliding window if it
        has one (a separate module). flashinfer compiles each module the
        first time it is planned (minutes on a fresh host, then cached on
        disk), so this moves the compile to load time, before the engine
        registers, instead of into the engine loop where P's lease and
        transfer timeouts run. Returns what ran, for the log."""
        device = torch.device(device)
        rows = self.WARM_ROWS
        pages = 2 * (-(-(rows + 1) // page_size))
        cache = KVCache(1, pages, page_size, self.kvh, self.d, dtype, device)
        k_pages, v_pages = cache.layer(0)
        table = list(range(pages))

        def one(seqs, num_decodes, window):
            n = sum(s.q_len for s in seqs)
            slots, pos = [], []
            for s in seqs:
                span = range(s.ctx_len - s.q_len, s.ctx_len)
                pos.extend(span)
                slots.extend(s.block_table[p // page_size] * page_size + p % page_size
                             for p in span)
            meta = BatchMeta(seqs, torch.tensor(slots, device=device),
                             torch.tensor(pos, device=device), num_decodes=num_decodes,
                             window=window)
            q = torch.zeros(n, self.h, self.d, dtype=dtype, device=device)
            kv = torch.zeros(n, self.kvh, self.d, dtype=dtype, device=device)
            self.forward(q, kv, kv, k_pages, v_pages, meta)

        second = table[pages // 2:]
        shapes = {
            "prefill 1 row": ([SeqMeta(0, 1, 1, table)], 0),
            f"prefill {rows} rows": ([SeqMeta(0, rows, rows, table)], 0),
            "decode": ([SeqMeta(0, 1, rows + 1, table)], 1),
            "prefill + decode": ([SeqMeta(0, 2, 2, second), SeqMeta(2, 1, rows + 1, table)], 1),
        }
        ran = []
        for window in (None, self.window) if self.window else (None,):
            for what, (seqs, num_decodes) in shapes.items():
                one(seqs, num_decodes, window)
                ran.append(what if window is None else f"{what}, window {window}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for st in self._groups.values():
            st.meta = st.slots = None       # the next round plans afresh
        return ran


@dataclass
class _Planned:
    """One cache group's flashinfer wrappers, and the round they hold."""
    prefill: object
    decode: object
    meta: BatchMeta | None = None
    slots: tuple | None = None          # its written rows' (page, offset, rows)


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def choose_backend(name: str, device, dtype: torch.dtype, **kw):
    """(backend, why): 'auto' picks flashinfer on CUDA when it is installed
    and has kernels for the model (float16 or bfloat16, head_dim 64, 128 or
    256), else torch. Asking for flashinfer where it cannot run is an error
    that says why."""
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}; use auto, torch or flashinfer")
    on_cuda = torch.device(device).type == "cuda"
    if name == "torch":
        return TorchAttention(**kw), "model.attention is torch"
    if not on_cuda and name == "auto":
        return TorchAttention(**kw), f"auto on {device}: flashinfer runs on CUDA only"
    unfit = None
    if not on_cuda:
        unfit = f"flashinfer runs on CUDA only, and this model is on {device}"
    elif dtype not in FLASHINFER_DTYPES:
        unfit = f"flashinfer has no {str(dtype).removeprefix('torch.')} kernels; " \
                "set model.dtype to bfloat16 or float16"
    elif kw["head_dim"] not in FLASHINFER_HEAD_DIMS:
        unfit = f"flashinfer has no kernels for head_dim {kw['head_dim']} " \
                f"(it has {', '.join(map(str, FLASHINFER_HEAD_DIMS))})"
    if unfit is None:
        try:
            return FlashInferAttention(**kw), (
                f"model.attention is {name}; flashinfer {FlashInferAttention.BACKEND} kernels "
                f"for {str(dtype).removeprefix('torch.')}, head_dim {kw['head_dim']}")
        except ImportError:
            unfit = "attention backend 'flashinfer' needs the gpu extra: " \
                    "pip install 'pdserve[gpu]' on a CUDA machine"
    if name == "flashinfer":
        raise ValueError(f"attention: flashinfer cannot serve this model: {unfit} "
                         "(or use attention: auto or torch)")
    return TorchAttention(**kw), f"auto fell back to torch: {unfit}"


def make_backend(name: str, device, dtype: torch.dtype, **kw):
    """The backend `choose_backend` picks, without the reason."""
    return choose_backend(name, device, dtype, **kw)[0]
