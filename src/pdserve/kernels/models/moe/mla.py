"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of one
entry a token and layer: the normed latent (kv_lora_rank) and the rotary
key (qk_rope_head_dim, one head shared by every query head), side by side
in a KVCache of one part (kernels/kv_cache.py): [pages, page_size, 1,
kv_lora_rank + qk_rope_head_dim]. Heads exist only in the projections.

Two ways to attend over those entries, the same numbers either way:
- expanded: each key's latent goes through kv_b_proj into per-head k_nope
  and v, then plain attention at qk_head_dim / v_head_dim. Costs
  keys x latent x heads x (nope + v) for the expansion, once per chunk:
  what a prefill chunk does, its queries many.
- absorbed: W_UK (kv_b's k_nope rows) folds into the query, so a head's
  query is a latent-sized vector that scores the cached latents directly
  (plus its rotary part against the rotary key), and W_UV applies once to
  the weighted latent sum. Costs queries x heads x latent x (nope + v) plus
  keys x heads x (latent + rope) for the scores and the sum: nothing per
  key and head beyond the dot products. What decode rows do (`absorb`,
  measured in docs/benchmarks.md, "Latent attention").

The softmax scale stays qk_head_dim ** -0.5 (times YaRN's mscale²) either
way. The torch reference here runs on any device. On CUDA in float16 or
bfloat16, where flashinfer is installed and has kernels for the shapes
(its fa2 MLA kernels: kv_lora_rank a multiple of 128, qk_rope_head_dim of
64, any head count and page size; DeepSeek-V3's 512 and 64 are),
a round's decode rows attend through flashinfer's
BatchMLAPagedAttentionWrapper instead (`FlashInferMlaDecode`): the
query absorption and W_UV stay torch's matmuls, the scores, softmax and
latent sum are its kernel's, over the latent pages in place. It reads
the latent and the rotary key as two strided views of the one cache
tensor (its kernels take a cache's page and token strides, the last dim
dense), so the layout the transfer path and the host and disk tiers
share is untouched. Prefill chunks and verify rows stay torch's
(expanded, or absorbed by the cost rule). `choose_mla_decode` picks at
model build and says why, for the load's log line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta, SeqMeta, decode_spans, page_csr
from pdserve.kernels.models.moe.specs import MlaSpec


@dataclass
class MlaWeights:
    """One layer's projections (this rank's heads under TP)."""
    q_a: torch.Tensor | None          # [q_lora, hidden]; None: q_b is q_proj [H*qk, hidden]
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor                 # [H * qk_head_dim, q_lora (or hidden)], rope dims de-interleaved
    kv_a: torch.Tensor                # [kv_lora + rope, hidden], rope rows de-interleaved
    kv_a_norm: torch.Tensor
    kv_b: torch.Tensor                # [H * (nope + v), kv_lora]
    w_uk: torch.Tensor                # [H, nope, kv_lora]: kv_b's key rows per head
    w_uv: torch.Tensor                # [H, v, kv_lora]: kv_b's value rows per head
    o_proj: torch.Tensor              # [hidden, H * v]


def deinterleave(w: torch.Tensor, rope: int) -> torch.Tensor:
    """Rows of a projection's rotary part, pairs (0, 1), (2, 3), ... made
    halves (0, 2, ...; 1, 3, ...): the checkpoint's interleaved rotary is
    then NeoX's rotate-half on the same pairs, for queries and keys alike,
    so scores are unchanged (what transformers' interleave does per call,
    done once at load)."""
    head = w.view(-1, rope, *w.shape[1:])
    return torch.cat([head[:, 0::2], head[:, 1::2]], dim=1).reshape(w.shape)


def mla_weights(spec: MlaSpec, w: dict, a: str, heads: int) -> MlaWeights:
    """Layer `a` (…self_attn.)'s projections from checkpoint tensors."""
    nope, rope, v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    q_b = w[a + ("q_b_proj.weight" if spec.q_lora_rank else "q_proj.weight")]
    kv_a = w[a + "kv_a_proj_with_mqa.weight"]
    if spec.rope_interleave:
        qh = q_b.view(heads, spec.qk_head_dim, -1)
        q_b = torch.cat([qh[:, :nope], deinterleave(qh[:, nope:].reshape(-1, qh.shape[-1]),
                                                    rope).view(heads, rope, -1)], 1)
        q_b = q_b.reshape(heads * spec.qk_head_dim, -1)
        kv_a = torch.cat([kv_a[:spec.kv_lora_rank], deinterleave(kv_a[spec.kv_lora_rank:], rope)])
    kv_b = w[a + "kv_b_proj.weight"]
    per_head = kv_b.view(heads, nope + v, spec.kv_lora_rank)
    return MlaWeights(
        w.get(a + "q_a_proj.weight") if spec.q_lora_rank else None,
        w.get(a + "q_a_layernorm.weight") if spec.q_lora_rank else None,
        q_b.contiguous(), kv_a.contiguous(), w[a + "kv_a_layernorm.weight"], kv_b,
        per_head[:, :nope].contiguous(), per_head[:, nope:].contiguous(), w[a + "o_proj.weight"])


class MlaAttention:
    """The torch reference: writes a round's entries into the latent pages,
    then attends, expanded for prefill chunks (and speculative verifies),
    absorbed (or, `absorb=False`, expanded) for the decode batch."""

    name = "torch-mla"

    def __init__(self, spec: MlaSpec, heads: int, absorb: bool = True,
                 decode: FlashInferMlaDecode | None = None):
        """`absorb`: each sequence's rows attend the way that costs fewer
        multiply-adds (`absorbs`); False: always expanded (the reference).
        `decode`: flashinfer's kernel for the absorbed decode rows
        (`choose_mla_decode`'s); None: torch's."""
        self.spec, self.h, self.absorb = spec, heads, absorb
        self.decode = decode

    def absorbs(self, rows: int, keys: int) -> bool:
        """Whether `rows` queries over `keys` keys cost less absorbed: per
        head, expanding costs keys x latent x (nope + v) plus rows x keys x
        (qk + v), absorbing rows x latent x (nope + v) plus rows x keys x
        (2 latent + rope). A decode row always (rows 1); a chunk over a
        context much longer than itself too; a first chunk never."""
        s = self.spec
        lat, widen = s.kv_lora_rank, s.kv_lora_rank * (s.qk_nope_head_dim + s.v_head_dim)
        expanded = keys * widen + rows * keys * (s.qk_head_dim + s.v_head_dim)
        absorbed = rows * widen + rows * keys * (2 * lat + s.qk_rope_head_dim)
        return self.absorb and absorbed < expanded

    def forward(self, q_nope, q_pe, entries, pages, meta: BatchMeta,
                w: MlaWeights) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), entries
        [T, latent + rope] (the rows' own, written first); pages
        [P, page_size, 1, latent + rope]. Returns [T, H, v_head_dim]."""
        pages = pages.squeeze(2)
        ps = pages.shape[1]
        slots, rows = meta.slot_mapping, meta.write_rows
        if rows is not None:
            pages[slots[rows] // ps, slots[rows] % ps] = entries[rows]
        else:
            pages[slots // ps, slots % ps] = entries
        out = q_nope.new_empty(q_nope.shape[0], self.h, self.spec.v_head_dim)
        n_pre = len(meta.seqs) - meta.num_decodes
        for s in meta.seqs[:n_pre]:
            r = slice(s.q_start, s.q_start + s.q_len)
            if s.ctx_len == s.q_len:         # a first chunk: its keys are its own rows
                keys = entries[r]
            else:
                table = torch.as_tensor(s.block_table[:-(-s.ctx_len // ps)], device=pages.device)
                keys = pages.index_select(0, table).reshape(-1, pages.shape[-1])[:s.ctx_len]
            qpos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=keys.device)
            kpos = torch.arange(s.ctx_len, device=keys.device)
            bias = torch.zeros(s.q_len, s.ctx_len, device=keys.device).masked_fill_(
                kpos[None, :] > qpos[:, None], float("-inf"))
            attend = self._absorbed if self.absorbs(s.q_len, s.ctx_len) else self._expanded
            out[r] = attend(q_nope[r][None], q_pe[r][None], keys[None], bias[None, None], w)[0]
        if meta.num_decodes and self.decode is not None and self.absorb:
            d0 = meta.seqs[n_pre].q_start
            r = slice(d0, d0 + meta.num_decodes)
            out[r] = self._absorbed_flashinfer(q_nope[r], q_pe[r], pages, meta, w)
        elif meta.num_decodes:
            d0 = meta.seqs[n_pre].q_start
            r = slice(d0, d0 + meta.num_decodes)
            tables, _, _, end = decode_spans(meta.seqs[n_pre:], ps, None)
            B, L = tables.shape[0], tables.shape[1] * ps
            keys = pages.index_select(0, tables.view(-1).to(pages.device)).view(B, L, -1)
            kpos = torch.arange(L, device=keys.device)
            bias = torch.zeros(B, L, device=keys.device).masked_fill_(
                kpos[None, :] >= end.to(keys.device)[:, None], float("-inf"))
            attend = self._absorbed if self.absorbs(1, L) else self._expanded
            out[r] = attend(q_nope[r].unsqueeze(1), q_pe[r].unsqueeze(1), keys,
                            bias[:, None, None], w)[:, 0]
        return out

    def _scores_softmax(self, scores: torch.Tensor, bias: torch.Tensor, dtype) -> torch.Tensor:
        return torch.softmax(scores.float() * self.spec.softmax_scale + bias, dim=-1).to(dtype)

    def _expanded(self, q_nope, q_pe, keys, bias, w: MlaWeights) -> torch.Tensor:
        """q [B, M, H, *] (M query rows a sequence), keys [B, L, latent +
        rope], bias broadcastable to the scores [B, H, M, L] (0 or -inf):
        keys expanded per head. Returns [B, M, H, v]."""
        s = self.spec
        latent, k_pe = keys[..., :s.kv_lora_rank], keys[..., s.kv_lora_rank:]
        kv = F.linear(latent, w.kv_b).view(*latent.shape[:2], self.h, -1)     # [B, L, H, nope+v]
        k_nope, v = kv[..., :s.qk_nope_head_dim], kv[..., s.qk_nope_head_dim:]
        # [B, H, M, L]: the plain part per head, the rotary part against the shared key
        scores = torch.einsum("bmhd,blhd->bhml", q_nope, k_nope) + \
            torch.einsum("bmhd,bld->bhml", q_pe, k_pe)
        probs = self._scores_softmax(scores, bias, q_nope.dtype)
        return torch.einsum("bhml,blhd->bmhd", probs, v)

    def _absorbed(self, q_nope, q_pe, keys, bias, w: MlaWeights) -> torch.Tensor:
        """As `_expanded`, with W_UK folded into the query and W_UV applied
        after the weighted sum of latents. Every product is one bmm whose
        batch is the heads (the absorptions) or the sequences (the scores
        and the sum, each sequence's latents read once for all its heads)."""
        s = self.spec
        B, M, H = q_nope.shape[:3]
        latent, k_pe = keys[..., :s.kv_lora_rank], keys[..., s.kv_lora_rank:]
        q_lat = torch.bmm(q_nope.permute(2, 0, 1, 3).reshape(H, B * M, -1), w.w_uk)
        q_lat = q_lat.view(H, B, M, -1).transpose(0, 1).reshape(B, H * M, -1)
        q_rot = q_pe.permute(0, 2, 1, 3).reshape(B, H * M, -1)
        scores = torch.baddbmm(torch.bmm(q_rot, k_pe.transpose(1, 2)), q_lat,
                               latent.transpose(1, 2))                  # [B, H*M, L]
        probs = self._scores_softmax(scores.view(B, H, M, -1), bias, q_nope.dtype)
        o_lat = torch.bmm(probs.view(B, H * M, -1), latent)              # [B, H*M, latent]
        o_lat = o_lat.view(B, H, M, -1).transpose(0, 1).reshape(H, B * M, -1)
        out = torch.bmm(o_lat, w.w_uv.transpose(1, 2))                   # [H, B*M, v]
        return out.view(H, B, M, -1).permute(1, 2, 0, 3)

    def _absorbed_flashinfer(self, q_nope, q_pe, pages, meta: BatchMeta,
                             w: MlaWeights) -> torch.Tensor:
        """The decode rows' absorbed attention, q [B, H, *]: W_UK folded
        into the query and W_UV applied after, as `_absorbed`; the scores,
        softmax and latent sum flashinfer's. Returns [B, H, v]."""
        assert self.decode is not None
        q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)     # [B, H, latent]
        o_lat = self.decode.run(q_lat.contiguous(), q_pe.contiguous(), pages, meta)
        return torch.bmm(o_lat.transpose(0, 1), w.w_uv.transpose(1, 2)).transpose(0, 1)


# flashinfer's MLA kernels are half precision (and fp8 on Hopper), none float32
MLA_DTYPES = (torch.float16, torch.bfloat16)


class FlashInferMlaDecode:
    """flashinfer's BatchMLAPagedAttentionWrapper (CUDA) for a round's
    decode rows. Planned once a round per cache group, from the round's
    decode SeqMetas (each row's pages from its kv_start's page on, as
    `decode_spans` reads them), and reused by each of the group's layers;
    each layer's cache is a strided view of the page-major pool. `flashinfer`
    is the imported module: `choose_mla_decode` imports it; a test may hand
    in a stand-in to run this on CPU."""

    # Pinned to fa2 rather than "auto". In 0.7.4, auto re-picks the kernel
    # family at every plan, by card and by the round: fa3 then fa2 on Hopper,
    # trtllm-gen, CuTe DSL or cutlass kernels on Blackwell, each with its own
    # input contract (cutlass only 128 heads), and compiles each on first
    # use (fa3's SM90 units for minutes), so a compile could land mid-serving
    # and a row's rounding would depend on its card and round. fa2 runs on
    # every card from SM80 on, for any head count and page size (the
    # latent a multiple of 128, the rotary key of 64), and `warm_up`
    # compiles it at load. fa3 may be faster on Hopper: set "fa3" to take it.
    BACKEND = "fa2"
    WORKSPACE_BYTES = 128 * 1024 * 1024

    def __init__(self, flashinfer, spec: MlaSpec, heads: int):
        self._fi, self.spec, self.h = flashinfer, spec, heads
        self._ws: torch.Tensor | None = None
        # per window (None: full history; it names the cache group): the
        # group's wrapper and the round it is planned for
        self._groups: dict = {}
        self.plans = 0                  # plans made (a round's decodes: one per group)

    def _plan(self, meta: BatchMeta, ps: int, dtype, device) -> _MlaPlanned:
        st = self._groups.get(meta.window)
        if st is None:
            if self._ws is None:
                self._ws = torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            st = self._groups[meta.window] = _MlaPlanned(
                self._fi.BatchMLAPagedAttentionWrapper(self._ws, backend=self.BACKEND))
        seqs = meta.seqs[len(meta.seqs) - meta.num_decodes:]
        # host tables: plan() reads them on the host and copies what the
        # kernel needs to the device itself
        indptr, indices, _ = page_csr(seqs, ps)
        lens = [s.ctx_len - s.kv_start // ps * ps for s in seqs]     # from the first page read
        i32 = torch.int32
        tables = self._fi.mla.MLAPlanMetadata.csr(
            torch.arange(len(seqs) + 1, dtype=i32), torch.tensor(indptr, dtype=i32),
            torch.tensor(indices, dtype=i32), torch.tensor(lens, dtype=i32))
        # causal=False: a decode row is its sequence's last key, so it sees
        # every key either way, and fa2's causal mode adds a tile-bound rule
        # (and a check of it at every plan) that a single row never needs
        st.wrapper.plan(metadata=tables, num_heads=self.h, head_dim_ckv=self.spec.kv_lora_rank,
                        head_dim_kpe=self.spec.qk_rope_head_dim, page_size=ps, causal=False,
                        sm_scale=self.spec.softmax_scale, q_data_type=dtype, kv_data_type=dtype,
                        query_layout="split", kv_cache_layout="split")
        st.meta = meta
        self.plans += 1
        return st

    def wrappers(self) -> list:
        """Each cache group's flashinfer wrapper (what it was last planned with)."""
        return [st.wrapper for st in self._groups.values()]

    def run(self, q_lat, q_pe, pages, meta: BatchMeta) -> torch.Tensor:
        """q_lat [B, H, latent] (W_UK absorbed), q_pe [B, H, rope], the
        round's decode rows; pages [P, page_size, latent + rope], this
        layer's (written first). Returns the latent sums [B, H, latent]."""
        st = self._groups.get(meta.window)
        if st is None or st.meta is not meta:
            st = self._plan(meta, pages.shape[1], q_lat.dtype, q_lat.device)
        lat = self.spec.kv_lora_rank
        out = torch.empty_like(q_lat)
        st.wrapper.run(query=(q_lat, q_pe), kv_cache=(pages[..., :lat], pages[..., lat:]),
                       out=out)
        return out

    def warm_up(self, dtype: torch.dtype, device, page_size: int = 16) -> None:
        """Plan and run one decode row on a scratch cache: flashinfer builds
        its module the first time it is planned (minutes on a fresh host,
        then cached on disk), and a card or shape it refuses fails here, at
        load, not mid-serving."""
        device = torch.device(device)
        pages = torch.zeros(2, page_size, self.spec.cache_width, dtype=dtype, device=device)
        slot = torch.tensor([page_size], device=device)
        meta = BatchMeta([SeqMeta(0, 1, page_size + 1, [0, 1])], slot, slot, num_decodes=1)
        q_lat = torch.zeros(1, self.h, self.spec.kv_lora_rank, dtype=dtype, device=device)
        q_pe = torch.zeros(1, self.h, self.spec.qk_rope_head_dim, dtype=dtype, device=device)
        self.run(q_lat, q_pe, pages, meta)
        if device.type == "cuda":
            torch.cuda.synchronize(device)      # a kernel's fault surfaces here
        self._groups.clear()
        self.plans = 0


@dataclass
class _MlaPlanned:
    """One cache group's wrapper, and the round it is planned for."""
    wrapper: Any                    # flashinfer's BatchMLAPagedAttentionWrapper
    meta: BatchMeta | None = None


def choose_mla_decode(spec: MlaSpec, heads: int, dtype: torch.dtype,
                      device) -> tuple[FlashInferMlaDecode | None, str]:
    """(flashinfer's decode kernel, or None for torch's; why) for latent
    attention of `spec` with `heads` heads in `dtype` on `device`."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None, f"torch's on {dev.type}: flashinfer's MLA kernels run on CUDA only"
    if dtype not in MLA_DTYPES:
        return None, (f"torch's: flashinfer has no {str(dtype).removeprefix('torch.')} MLA "
                      "kernels (set model.dtype to bfloat16 or float16)")
    lat, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    if lat % 128 or rope % 64:
        return None, (f"torch's: flashinfer's {FlashInferMlaDecode.BACKEND} MLA kernels need "
                      f"kv_lora_rank a multiple of 128 and qk_rope_head_dim a multiple of 64; "
                      f"this model's are {lat} and {rope}")
    try:
        import flashinfer
    except ImportError:
        return None, "torch's: flashinfer is not installed (pip install 'pdserve[gpu]')"
    try:
        kernel = FlashInferMlaDecode(flashinfer, spec, heads)
        kernel.warm_up(dtype, dev)
    except Exception as e:      # the JIT build, a card it refuses (before SM80), the driver
        return None, (f"torch's: flashinfer's MLA decode failed at load: "
                      f"{type(e).__name__}: {e}")
    return kernel, (f"flashinfer's {FlashInferMlaDecode.BACKEND} MLA kernel "
                    f"(BatchMLAPagedAttentionWrapper), {heads} heads, latent {lat} + rotary "
                    f"key {rope}; prefill chunks torch's")
