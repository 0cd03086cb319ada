"""flashinfer's paged attention (CUDA): the `attention: flashinfer` backend,
and what it has kernels for. `choose_backend` (backends.py) decides when a
model gets it.

A captured decode step (kernels/capture.py) runs flashinfer's decode too:
a `CapturedDecode` per batch bucket and cache group holds a decode wrapper
in CUDA-graph mode over fixed buffers (the CSR page table's indptr,
indices and last-page lengths). `plan_captured` plans it outside the graph
before each replay (it copies the round's table into those buffers and
the kernels' split schedule into the wrapper's workspace, on the replay's
stream); the graph holds only the K/V write and `run()`. In graph mode
flashinfer always splits the keys and sizes its grid from the bucket, not
the round, so one recording serves every table (flashinfer's
scheduler.cuh; vLLM and SGLang capture it the same way)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta, TorchAttention, page_csr
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.models.model_config import ModelError

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


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
            st = self._groups[window] = _Planned(
                self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace(device), "NHD",
                                                             backend=self.BACKEND),
                self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace(device), "NHD", use_tensor_cores=self.tensor_cores,
                    backend=self.BACKEND))
        return st

    @property
    def tensor_cores(self) -> bool:
        """Decode on tensor cores past a GQA group of 4, as SGLang and vLLM
        choose; flashinfer has CUDA-core decode kernels for groups 1, 2, 3,
        4, 6, 8 and 16. The eager and the captured decode choose alike."""
        return self.group > 4

    def _workspace(self, device) -> torch.Tensor:
        if self._ws is None:
            # zeroed: the decode wrapper asks for a zeroed workspace on first use.
            # One float workspace for every wrapper: their runs are stream-ordered,
            # and each keeps its plan in its own int workspace.
            self._ws = torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._ws

    @staticmethod
    def _csr(seqs, ps: int, window):
        """Host tensors: plan() reads indptr and last_page_len on the host and
        copies what the kernels need to the device itself, so tables built on
        the GPU would cost a device-to-host sync every round."""
        for s in seqs:
            if s.kv_start % ps and (window is None or
                                    s.kv_start > s.ctx_len - s.q_len - window + 1):
                raise ModelError(
                    f"flashinfer cannot start a sequence's keys mid-page (position "
                    f"{s.kv_start}, page size {ps}) inside its window: a replay that "
                    "re-feeds a window not aligned to pages; use attention: torch, or a "
                    "window and replay that are multiples of the page size")
        indptr, indices, last = page_csr(seqs, ps)
        i32 = dict(dtype=torch.int32)
        return torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32)  # type: ignore[arg-type]

    def _window_left(self, window) -> int:
        """flashinfer's window: keys to the left of the query (-1: all)."""
        return window - 1 if window is not None else -1

    def _plan_kw(self, window, dtype) -> dict:
        kw = dict(window_left=self._window_left(window), sm_scale=self.scale,
                  q_data_type=dtype, kv_data_type=dtype)
        if self.softcap is not None:       # passed only when set: a stand-in need not know it
            kw["logits_soft_cap"] = self.softcap
        return kw

    def _plan(self, meta: BatchMeta, ps: int, dtype, device) -> "_Planned":
        st = self._wrappers(meta.window, device)
        n_pre = len(meta.seqs) - meta.num_decodes
        kw = self._plan_kw(meta.window, dtype)
        if n_pre:
            pre = meta.seqs[:n_pre]
            qo = torch.tensor([0] + [s.q_start + s.q_len for s in pre], dtype=torch.int32)
            indptr, indices, last = self._csr(pre, ps, meta.window)
            st.prefill.plan(qo, indptr, indices, last, self.h, self.kvh, self.d, ps,  # type: ignore[attr-defined]
                            causal=True, **kw)
        if meta.num_decodes:
            indptr, indices, last = self._csr(meta.seqs[n_pre:], ps, meta.window)
            st.decode.plan(indptr, indices, last, self.h, self.kvh, self.d, ps, **kw)  # type: ignore[attr-defined]
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
        cap = meta._prep
        if isinstance(cap, CapturedDecode):    # a captured bucket's: planned before the replay
            self._write(k, v, k_pages, v_pages, cap.page, cap.off, None)
            out = torch.empty_like(q)
            cap.wrapper.run(q.contiguous(), (k_pages, v_pages), out=out)  # type: ignore[attr-defined]
            return out
        st = self._groups.get(meta.window)
        if st is None or st.meta is not meta:
            st = self._plan(meta, k_pages.shape[1], q.dtype, q.device)
        self._write(k, v, k_pages, v_pages, *st.slots)  # type: ignore[misc]
        q = q.contiguous()                 # a slice of the fused q/k rotation
        out = torch.empty_like(q)
        n_pre = len(meta.seqs) - meta.num_decodes
        split = meta.seqs[n_pre].q_start if meta.num_decodes else q.shape[0]
        if n_pre:
            st.prefill.run(q[:split], (k_pages, v_pages), out=out[:split])  # type: ignore[union-attr]
        if meta.num_decodes:
            st.decode.run(q[split:], (k_pages, v_pages), out=out[split:])  # type: ignore[union-attr]
        return out

    # ---- the captured decode ----------------------------------------------

    def captured_decode(self, batch: int, max_pages: int, window, dtype,
                        page: torch.Tensor, off: torch.Tensor) -> "CapturedDecode":
        """A decode wrapper in CUDA-graph mode for a bucket of `batch` rows
        whose tables reach `max_pages` pages, one cache group (`window`);
        `page` and `off` are the bucket's buffers of where each row's K/V
        goes. Pinned to BACKEND: under "auto" the kernel family is part of
        the frozen graph, and could differ from the eager step's."""
        device = page.device
        sizes = (batch + 1, batch * max_pages, batch)          # indptr, indices, last
        buffers = [torch.zeros(n, dtype=torch.int32, device=device) for n in sizes]
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace(device), "NHD", use_cuda_graph=True,
            use_tensor_cores=self.tensor_cores, paged_kv_indptr_buffer=buffers[0],
            paged_kv_indices_buffer=buffers[1], paged_kv_last_page_len_buffer=buffers[2],
            backend=self.BACKEND)
        # the plan's tables are written here, then copied into the buffers:
        # from pinned memory the copy queues behind the GPU's work, where
        # from pageable memory it would wait for the stream to drain first
        host = tuple(torch.zeros(n, dtype=torch.int32, pin_memory=device.type == "cuda")
                     for n in sizes)
        return CapturedDecode(wrapper, page, off, batch, max_pages, self._plan_kw(window, dtype),
                              host, torch.zeros(sizes[1], dtype=torch.int32, device=device))

    def plan_captured(self, cap: "CapturedDecode", seqs: list, ps: int, scratch: int) -> None:
        """Plan `cap` for a round of `seqs` (decodes, at most its batch),
        outside the graph, before its replay: each row reads its pages from
        its kv_start's page on; a padding row reads the first slot of the
        scratch page, where it writes (the planner never grants that page)."""
        n, b = len(seqs), cap.batch
        rows_ptr, rows_indices, rows_last = page_csr(seqs, ps)
        widest = max(np.diff(rows_ptr), default=0)
        if widest > cap.max_pages:
            raise ValueError(f"a captured decode row reads {widest} pages, its bucket "
                             f"holds {cap.max_pages}")
        if cap.planned is not None and not cap.planned.query():  # type: ignore[attr-defined]
            # the host tables, and the wrapper's own pinned staging of its
            # schedule, are rewritten only once the last plan's copies ran
            cap.planned.synchronize()  # type: ignore[attr-defined]
        indptr_t, indices_t, last_t = cap.host
        indptr, indices, last = indptr_t.numpy(), indices_t.numpy(), last_t.numpy()
        filled = rows_ptr[-1]
        indptr[:n + 1] = rows_ptr
        indptr[n + 1:] = filled + np.arange(1, b - n + 1)     # a padding row: one page
        used = int(indptr[-1])
        indices[:filled] = rows_indices
        indices[filled:used] = scratch
        last[:n] = rows_last
        last[n:] = 1
        # the indices go to the device first: flashinfer copies host indices
        # into its buffer with a blocking copy (a stream sync), device ones not
        staged = cap.indices[:used]
        staged.copy_(indices_t[:used], non_blocking=True)
        cap.wrapper.plan(indptr_t, staged, last_t,  # type: ignore[attr-defined]
                         self.h, self.kvh, self.d, ps, **cap.kw)
        if cap.page.is_cuda:
            cap.planned = torch.cuda.Event()
            cap.planned.record()  # type: ignore[attr-defined]

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
class CapturedDecode:
    """One captured bucket's attention for one cache group: flashinfer's
    decode wrapper in CUDA-graph mode on its fixed buffers, the bucket's
    buffers of where each row's K/V goes, and how it is planned. A
    BatchMeta carries it as its `_prep`, so the forward run inside the
    graph reads nothing of the round."""
    wrapper: object
    page: torch.Tensor              # [batch] long: the page each row's K/V goes to
    off: torch.Tensor               # [batch] long: its slot in the page
    batch: int
    max_pages: int                  # the most pages a row's table may hold
    kw: dict                        # the plan's keywords (window, scale, dtypes)
    host: tuple                     # host indptr, indices, last (pinned on CUDA)
    indices: torch.Tensor           # the indices on the device, for the plan to copy
    planned: object = None          # a CUDA event after the last plan's copies


@dataclass
class _Planned:
    """One cache group's flashinfer wrappers, and the round they hold."""
    prefill: object
    decode: object
    meta: BatchMeta | None = None
    slots: tuple | None = None          # its written rows' (page, offset, rows)

