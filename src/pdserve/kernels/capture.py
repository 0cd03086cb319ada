"""The captured decode step: a decode-only round's forward run over static
input buffers, padded to a batch-size bucket, so that it can be recorded
once and replayed (a CUDA graph on a GPU, a torch.compile'd graph on CPU).

A decode round's forward depends on the batch only through a few tensors:
the token ids, their positions, and per cache group where each row's K/V
goes (page, offset), the pages it reads (a table, padded to a width
bucket) and the mask over them (an additive float32 bias). `DecodeCapture`
keeps those as buffers per (batch bucket, width bucket), fills them each
round (one copy each), and runs the model's own forward on BatchMetas whose
attention preparation (`BatchMeta._prep`) already points at the buffers, so
no Python in the forward depends on the batch.

With flashinfer's attention the buffers per cache group are where each
row's K/V goes and a decode wrapper in CUDA-graph mode
(flashinfer_attention.CapturedDecode), planned before each replay; its
kernels' grid does not depend on the table's width, so there is one width
bucket, the widest.

Padding rows are harmless: each writes its K/V into a scratch page that the
planner never hands out (the executor allocates one page more per cache
group) and attends over that page's first slot only.

Modes (`choose_capture`): CUDA_GRAPH on a GPU with torch's or flashinfer's
attention;
COMPILE, torch.compile (dynamic shapes: one compile for every bucket) on
CPU, where `auto` leaves it off because it did not pay on a two-core host
(docs/benchmarks.md); STATIC, the same buffers run eagerly (what the tests
hold to the eager forward, and the compile's fallback); OFF. Models with
state layers (Qwen3.5, LFM2) run eagerly: their rounds read state slots
outside these buffers. A mixture-of-experts model is captured where its
routed experts run torch's grouped matmul (experts.py: nothing read back
to the host); its padding rows are routed too, and `_Bucket.live` keeps
them out of the experts' token counts.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.attention import BatchMeta, TorchAttention
from pdserve.kernels.flashinfer_attention import CapturedDecode, FlashInferAttention
from pdserve.kernels.models.moe.experts import GROUPED

log = logging.getLogger("pdserve.kernels")

CAPTURE = ("auto", "off", "on")


class CaptureMode(enum.Enum):
    OFF = "off"
    STATIC = "static"           # static buffers, run eagerly
    COMPILE = "compile"         # torch.compile over the static buffers (CPU)
    CUDA_GRAPH = "cuda_graph"   # recorded once per bucket, replayed (CUDA)


def choose_capture(setting: str, model) -> tuple[CaptureMode, str]:
    """(mode, why) for `engine.capture` on this model."""
    if setting not in CAPTURE:
        raise ValueError(f"engine.capture is {setting!r}; use one of {', '.join(CAPTURE)}")
    if setting == "off":
        return CaptureMode.OFF, "engine.capture is off"
    if model.cfg.state_layers():
        return CaptureMode.OFF, "the model's state layers run eagerly"
    if getattr(model, "tensor_parallel", False):
        return CaptureMode.OFF, ("a tensor-parallel engine's step runs eagerly: each round is "
                                 "sent to its other ranks before the forward")
    if model.cfg.mla is not None:
        return CaptureMode.OFF, "latent attention runs eagerly"
    if model.cfg.moe is not None and any(e.path is not GROUPED for e in model.expert_layers()):
        # the loop reads each expert's row count back: shapes change every round
        return CaptureMode.OFF, ("a mixture-of-experts layer runs eagerly where its experts "
                                 "loop (only torch's grouped matmul is captured)")
    if type(model.attention) not in (TorchAttention, FlashInferAttention):
        return CaptureMode.OFF, f"{model.attention.name} attention runs eagerly"
    if isinstance(model.attention, FlashInferAttention) and model.device.type != "cuda":
        return CaptureMode.OFF, "flashinfer's decode is captured on CUDA only"
    if getattr(model, "native_layers", None) is not None:
        # one C call a layer already; a captured step would take torch's
        # path, and a decode row's bits would then depend on the round
        return CaptureMode.OFF, "every row runs pdserve's C layers"
    if model.device.type == "cuda":
        return CaptureMode.CUDA_GRAPH, f"engine.capture is {setting}: CUDA graphs"
    if setting == "on":
        return CaptureMode.COMPILE, "engine.capture is on: torch.compile on CPU"
    return CaptureMode.OFF, ("auto on CPU: torch.compile's decode step did not pay for its "
                             "compile on a two-core host (docs/benchmarks.md); capture: on "
                             "compiles it")


def buckets(limit: int) -> list[int]:
    """Powers of two up to `limit`, and `limit` itself."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def bucket_of(n: int, sizes: list[int]) -> int | None:
    for b in sizes:
        if b >= n:
            return b
    return None


@dataclass
class _GroupBuffers:
    page: torch.Tensor      # [B] long: the page each row's K/V goes to
    off: torch.Tensor       # [B] long: its slot in the page
    # torch's attention: [B, W] long, the pages each row reads, and
    # [B, 1, 1, W * page_size] float32, 0 or -inf; flashinfer's: its wrapper
    tables: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    planned: CapturedDecode | None = None


@dataclass
class _Bucket:
    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    groups: list[_GroupBuffers]
    metas: list[BatchMeta]
    live: torch.Tensor      # [1] long: the round's real rows (a MoE counts only those)
    graph: object = None    # a torch.cuda.CUDAGraph (CUDA_GRAPH)
    out: torch.Tensor | None = None


class DecodeCapture:
    """Captured decode steps of `model` over `caches` (one KVCache per KV
    cache group, each with its last page kept as scratch) for batches up to
    `max_batch` and tables up to `max_pages` pages."""

    def __init__(self, model, caches: list, mode: CaptureMode, max_batch: int, max_pages: int,
                 windows: list):
        self.model, self.caches, self.mode = model, caches, mode
        self.batch_sizes = buckets(max_batch)
        self.planned = isinstance(model.attention, FlashInferAttention)
        self.widths = [max_pages] if self.planned else buckets(max_pages)
        self.windows = windows          # each KV group's window (None: full)
        self.ps = caches[0].page_size
        self.scratch = [c.data.shape[0] - 1 for c in caches]
        # a MoE's sparse layers, told each bucket's live rows while it runs
        self._experts = model.expert_layers() if model.cfg.moe is not None else []
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._step = self._forward
        if mode is CaptureMode.COMPILE:
            # traced outside inference mode (under no_grad): the compiler
            # cannot functionalize views of inference tensors
            self._step = torch.compile(self._forward_grad_free, dynamic=True)
        self.capture_s = 0.0
        self.replays = 0

    @property
    def steps(self) -> int:
        """How many (batch, width) buckets are built."""
        return len(self._buckets)

    # ---- building ------------------------------------------------------

    def _bucket(self, b: int, w: int) -> _Bucket:
        key = (b, w)
        got = self._buckets.get(key)
        if got is not None:
            return got
        dev = self.model.device
        long = dict(dtype=torch.long, device=dev)
        groups, metas = [], []
        positions = torch.zeros(b, **long)  # type: ignore[arg-type]
        for g, window in enumerate(self.windows):
            gb = _GroupBuffers(torch.zeros(b, **long), torch.zeros(b, **long))  # type: ignore[arg-type]
            prep: object
            if self.planned:
                gb.planned = prep = self.model.attention.captured_decode(
                    b, w, window, self.caches[g].data.dtype, gb.page, gb.off)
            else:
                gb.tables = torch.zeros(b, w, **long)  # type: ignore[arg-type]
                gb.bias = torch.zeros(b, 1, 1, w * self.ps, device=dev)
                prep = {"page": gb.page, "off": gb.off, "rows": None, "pre": [],
                        "dec": (0, b, gb.tables, gb.bias)}
            groups.append(gb)
            metas.append(BatchMeta([], gb.page, positions, num_decodes=b, window=window,
                                   _prep=prep))
        got = _Bucket(torch.zeros(b, **long), positions,  # type: ignore[arg-type]
                      torch.arange(b, **long), groups, metas,  # type: ignore[arg-type]
                      torch.zeros(1, **long))  # type: ignore[arg-type]
        self._fill_padding(got, 0)
        for gb, scratch in zip(groups, self.scratch):    # recorded on a plan of padding only
            if gb.planned is not None:
                self.model.attention.plan_captured(gb.planned, [], self.ps, scratch)
        self._buckets[key] = got
        return got

    def _forward(self, ids, metas, rows):
        return self.model.forward(ids, metas, self.caches, rows)

    @contextlib.contextmanager
    def _live(self, bk: "_Bucket"):
        """While a bucket's step runs or is recorded, a MoE's sparse layers
        count only its live rows."""
        for e in self._experts:
            e.live_rows = bk.live
        try:
            yield
        finally:
            for e in self._experts:
                e.live_rows = None

    def _forward_grad_free(self, ids, metas, rows):
        forward = inspect.unwrap(type(self.model).forward)    # without its inference_mode
        with torch.no_grad():
            return forward(self.model, ids, metas, self.caches, rows)

    def _call(self, bk: "_Bucket") -> torch.Tensor:
        with self._live(bk):
            if self.mode is CaptureMode.COMPILE:
                return self._step(bk.ids, bk.metas, bk.rows)
            with torch.inference_mode():
                return self._step(bk.ids, bk.metas, bk.rows)

    def capture(self) -> float:
        """Build every bucket (largest first, so shared scratch buffers
        reach their size once) and record or compile its step; returns the
        seconds it took, also logged."""
        if self.mode is CaptureMode.OFF:
            return 0.0
        t0 = time.perf_counter()
        keys = [(b, w) for b in reversed(self.batch_sizes) for w in reversed(self.widths)]
        if self.mode is CaptureMode.COMPILE:        # dynamic shapes: two calls compile it
            keys = keys[:1] + keys[-1:]
        for b, w in keys:
            bk = self._bucket(b, w)
            if self.mode is CaptureMode.CUDA_GRAPH:
                self._record(bk)
            else:
                self._call(bk)
        self.capture_s = time.perf_counter() - t0
        log.info("decode step captured (%s) for batch sizes %s and tables up to %d pages in "
                 "%.1f s", self.mode.value, self.batch_sizes, self.widths[-1], self.capture_s)
        return self.capture_s

    def _record(self, bk: _Bucket) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode(), self._live(bk):
            for _ in range(2):                      # warm: lazy init, workspace sizes
                self._forward(bk.ids, bk.metas, bk.rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = getattr(self, "_pool", None)
        with torch.cuda.graph(graph, pool=pool), torch.inference_mode(), self._live(bk):
            bk.out = self._forward(bk.ids, bk.metas, bk.rows)
        self._pool = graph.pool()
        bk.graph = graph

    # ---- a round -------------------------------------------------------

    def covers(self, metas: list[BatchMeta]) -> bool:
        """Whether this round is one the capture runs: decodes only, no row
        skipping its K/V write, within the largest buckets."""
        if self.mode is CaptureMode.OFF or not metas:
            return False
        m = metas[0]
        n = len(m.seqs)
        if n == 0 or m.num_decodes != n or n > self.batch_sizes[-1]:
            return False
        return all(x.write_rows is None for x in metas)

    def run(self, ids: torch.Tensor, metas: list[BatchMeta]) -> torch.Tensor | None:
        """The round's logits ([rows, vocab], float32), or None when its
        tables are wider than the widest bucket (the caller runs it eagerly)."""
        n = len(metas[0].seqs)
        ps = self.ps
        host = []
        width = 0
        for m in metas:
            lo = [s.kv_start // ps for s in m.seqs]
            counts = [-(-s.ctx_len // ps) - a for s, a in zip(m.seqs, lo)]
            host.append((lo, counts))
            width = max(width, max(counts))
        w = bucket_of(width, self.widths)
        b = bucket_of(n, self.batch_sizes)
        if w is None or b is None:
            return None
        bk = self._bucket(b, w)
        bk.ids[:n].copy_(ids, non_blocking=True)
        bk.positions[:n].copy_(metas[0].positions, non_blocking=True)
        for m, (lo, counts), gb in zip(metas, host, bk.groups):
            slots = m.slot_mapping
            gb.page[:n].copy_(slots // ps, non_blocking=True)
            gb.off[:n].copy_(slots % ps, non_blocking=True)
            if gb.tables is None:
                continue
            tables = np.zeros((n, w), dtype=np.int64)
            kpos = np.full((n, w * ps), -1, dtype=np.int64)
            ctx = np.empty(n, dtype=np.int64)
            for i, (s, a, k) in enumerate(zip(m.seqs, lo, counts)):
                tables[i, :k] = s.block_table[a:a + k]
                tables[i, k:] = s.block_table[a]
                kpos[i] = np.arange(w * ps) + a * ps
                ctx[i] = s.ctx_len
            ok = kpos < ctx[:, None]
            if m.window is not None:
                ok &= kpos > ctx[:, None] - 1 - m.window
            bias = np.where(ok, 0.0, -np.inf).astype(np.float32)
            gb.tables[:n].copy_(torch.from_numpy(tables), non_blocking=True)
            gb.bias[:n, 0, 0].copy_(torch.from_numpy(bias), non_blocking=True)  # type: ignore[index]
        self._fill_padding(bk, n)
        bk.live.fill_(n)
        for m, gb, scratch in zip(metas, bk.groups, self.scratch):
            if gb.planned is not None:
                self.model.attention.plan_captured(gb.planned, m.seqs, ps, scratch)
        self.replays += 1
        if bk.graph is not None:
            bk.graph.replay()  # type: ignore[attr-defined]
            return bk.out[:n]  # type: ignore[index]
        return self._call(bk)[:n]

    def _fill_padding(self, bk: _Bucket, n: int) -> None:
        """Rows n.. of a bucket: token 0 at position 0, writing into the
        scratch page and reading its first slot only."""
        if n == bk.ids.shape[0]:
            return
        bk.ids[n:] = 0
        bk.positions[n:] = 0
        for gb, scratch in zip(bk.groups, self.scratch):
            gb.page[n:] = scratch
            gb.off[n:] = 0
            if gb.tables is not None:
                gb.tables[n:] = scratch
                gb.bias[n:] = float("-inf")  # type: ignore[index]
                gb.bias[n:, 0, 0, 0] = 0.0  # type: ignore[index]
