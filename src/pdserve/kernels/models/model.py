"""A Llama-family decoder over a paged KV cache: RMSNorm, rotary positions,
grouped-query attention, SwiGLU; Qwen2's q/k/v biases and Mistral's sliding
window where they differ. Weights use Hugging Face's names, so a checkpoint's
safetensors load as they are.

`PagedDecoder` is what every architecture here shares: its layers fall into
cache groups (`ModelConfig.cache_groups`), each group with its own KVCache
holding only its layers, and a round's forward takes one BatchMeta per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta
from pdserve.kernels.cpu.layer import native_layers_for
# rms_norm lives with the other elementwise ops; the families import it from here
from pdserve.kernels.fused_ops import TorchOps, choose_fused_ops, rms_norm
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.lora.batched import DOWN, GATE_UP, O, QKV, BatchedLora, LoraStacks
from pdserve.kernels.models.model_config import ModelConfig, ModelError, weight_names
from pdserve.kernels.cpu.quantized import (
    QuantizedLinear, QuantizedTensor, dense, fuse, linear, packed, quantized_linears)
from pdserve.kernels.models.rope import Rotary
from pdserve.kernels.models.state_cache import SeqState, StateBatch, StateCache, StateRound
from pdserve.kernels.tensor_parallel import TpError, TpShard


def random_weights(cfg: ModelConfig, seed: int, dtype=torch.float32, device="cpu",
                   names: list[str] | None = None) -> dict:
    """Seeded weights (the tiny preset): the same on every machine. Drawn
    on `device` (the GPU benchmarks' large shapes: never on the host).
    `names`: the checkpoint's tensors (default the Llama family's); a
    Qwen3-MoE's router, experts and q/k norms are drawn too."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = {
        "embed_tokens": (cfg.vocab_size, cfg.hidden_size),
        "lm_head": (cfg.vocab_size, cfg.hidden_size),
        "q_proj": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
        "k_proj": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
        "v_proj": (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
        "o_proj": (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
        "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
        "up_proj": (cfg.intermediate_size, cfg.hidden_size),
        "down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }
    if cfg.moe is not None:
        width = cfg.moe.intermediate
        shapes.update({"gate": (cfg.moe.num_experts, cfg.hidden_size),
                       "experts.gate_proj": (width, cfg.hidden_size),
                       "experts.up_proj": (width, cfg.hidden_size),
                       "experts.down_proj": (cfg.hidden_size, width)})
    out = {}
    for name in names or weight_names(cfg):
        if name.endswith("norm.weight"):
            qk = name.endswith(("q_norm.weight", "k_norm.weight"))
            out[name] = torch.ones(cfg.head_dim if qk else cfg.hidden_size, dtype=dtype,
                                   device=device)
            continue
        key = name.split(".")[-2]
        if ".experts." in name:
            key = f"experts.{key}"
        if name.endswith(".bias"):
            shape = (shapes[key][0],)
        else:
            shape = shapes[key]  # type: ignore[assignment]
        out[name] = (torch.randn(shape, generator=g, device=device) * 0.5 /
                     shape[-1] ** 0.5).to(dtype)
    return out


@dataclass
class HybridLayer:
    """One layer of a model with state layers (Qwen3.5, LFM2): a norm, the
    mixer (attention, or a state mixer at `state_layer`), a norm, and a
    gated SiLU MLP."""
    ln_in: torch.Tensor
    mixer: object                 # the family's attention, or its state mixer
    state_layer: int | None
    ln_post: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class PagedDecoder:
    """Cache groups and their KV caches; the architecture's forward is the
    subclass's. Layer i's K/V live in cache `slots[i][0]` as its layer
    `slots[i][1]`."""

    embed: torch.Tensor          # [vocab (a rank's rows under TP), hidden]: the subclass's
    lm_head: torch.Tensor | QuantizedLinear   # quantized: a GGUF's (kernels/cpu/quantized.py)

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, attention):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.attention = attention
        self.groups = cfg.cache_groups()
        self.slots: list = [None] * cfg.num_layers
        for g, spec in enumerate(self.groups):
            for j, layer in enumerate(spec.layers):
                self.slots[layer] = (g, j)  # type: ignore[assignment]
        # what each group's BatchMeta must say its window is
        self._windows = [spec.window if spec.sliding else None for spec in self.groups]
        # this rank's part in a tensor-parallel engine (kernels/tensor_parallel.py)
        self.tp: TpShard | None = None

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows for `ids` (under TP: summed over the ranks)."""
        return self.embed[ids] if self.tp is None else self.tp.embed(self.embed, ids)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: as it is, or summed over the ranks."""
        return x if self.tp is None else self.tp.reduce(x)

    def head(self, h: torch.Tensor, dense_rows: int = 0) -> torch.Tensor:
        """Logits over the whole vocabulary (under TP: gathered); a quantized
        head's first `dense_rows` rows (prefill chunks') through its dense copy."""
        if self.tp is None:
            return linear(h, self.lm_head, dense_rows=dense_rows)
        assert isinstance(self.lm_head, torch.Tensor)     # shards are never quantized
        return self.tp.logits(h, self.lm_head)

    def cache_groups(self, replayable: bool = False) -> list:
        """The model's CacheGroupSpecs, in cache order (see
        ModelConfig.cache_groups); `replayable` marks sliding groups §1.3's."""
        return self.cfg.cache_groups(replayable)

    def new_caches(self, pages_per_group: list[int], page_size: int,
                   companions: list | None = None) -> list[KVCache]:
        """One KVCache per cache group, of that group's pages and layers;
        `companions`: per group, a draft model's layers its pages also hold
        (a KVShape, or None)."""
        if len(pages_per_group) != len(self.groups):
            raise ValueError(f"{len(pages_per_group)} page counts for the model's "
                             f"{len(self.groups)} cache groups")
        c = self.cfg
        extra = companions or [None] * len(self.groups)
        return [KVCache(len(spec.layers), pages, page_size, c.num_kv_heads, c.head_dim,
                        self.dtype, self.device, companion=x, parts=c.kv_parts)
                for spec, pages, x in zip(self.groups, pages_per_group, extra)]

    def new_cache(self, pages: int, page_size: int) -> KVCache:
        """The one cache of a single-group model (every layer the same window)."""
        if len(self.groups) != 1:
            raise ModelError(f"this model has {len(self.groups)} cache groups; "
                             "use new_caches(pages_per_group, page_size)")
        return self.new_caches([pages], page_size)[0]

    def new_state_cache(self, slots: int) -> StateCache:
        """A pool of `slots` state slots for this model's state layers."""
        return StateCache.for_model(self.cfg, slots, self.dtype, self.device)

    def state_round(self, states: StateBatch | None, seqs: list) -> StateRound:
        """The round's StateRound for a model with state layers. `states`
        None: whole fresh prompts whose state is not kept."""
        if states is None:
            begun = [i for i, s in enumerate(seqs) if s.ctx_len != s.q_len]
            if begun:
                raise ValueError(f"sequence {begun[0]} continues a history, which needs its "
                                 "state: pass states (a StateBatch)")
            states = StateBatch(self.new_state_cache(len(seqs)),
                                [SeqState(-1, i) for i in range(len(seqs))])
        layers = len(self.cfg.state_layers())
        if states.cache.layers != layers:
            raise ValueError(f"the StateCache holds {states.cache.layers} state layers; this "
                             f"model has {layers} (use new_state_cache)")
        return StateRound(states, seqs)

    def hybrid_forward(self, input_ids, meta, cache, logits_indices, states, norm):
        """The forward of a model of HybridLayers: `norm(x, weight, eps)` is
        the family's RMS norm, `self._attend` its attention, a state layer's
        mixer runs on the round's StateRound. Logits (float32) for the rows
        in `logits_indices`."""
        c = self.cfg
        metas, caches = self.per_group(meta, cache)
        m = metas[0]
        rnd = self.state_round(states, m.seqs)
        h = self.embed[input_ids]
        rope = self.rotary.at(m.positions)
        for layer in self.layers:
            x = norm(h, layer.ln_in, c.rms_norm_eps)
            if layer.state_layer is None:
                h = h + self._attend(layer.mixer, x, metas, caches, rope)
            else:
                h = h + layer.mixer.forward(x, m, rnd, layer.state_layer)
            x = norm(h, layer.ln_post, c.rms_norm_eps)
            gu = F.linear(x, layer.gate_up)
            inter = gu.shape[-1] // 2
            h = h + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], layer.down)
        h = norm(h[logits_indices], self.norm, c.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    def per_group(self, meta, cache) -> tuple[list, list]:
        """(metas, caches), one per cache group; a lone BatchMeta and KVCache
        stand for a single-group model's. A meta's window must be its group's:
        a mismatch would attend over the wrong keys without a sound."""
        if isinstance(cache, KVCache):
            meta, cache = [meta], [cache]
        if len(meta) != len(self.groups) or len(cache) != len(self.groups):
            raise ValueError(f"{len(meta)} BatchMetas and {len(cache)} caches for the "
                             f"model's {len(self.groups)} cache groups")
        for g, (m, want) in enumerate(zip(meta, self._windows)):
            if m.window != want:
                raise ValueError(f"cache group {g}'s BatchMeta has window {m.window}, but its "
                                 f"layers attend over {want or 'all'} keys")
        return meta, cache


class DecoderModel(PagedDecoder):
    def __init__(self, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device,
                 attention):
        super().__init__(cfg, dtype, device, attention)
        # a GGUF's quantized tensors stay quantized (kernels/cpu/quantized.py)
        w: dict[str, Any] = {k: v if isinstance(v, QuantizedTensor) else v.to(dtype=dtype, device=self.device)
             for k, v in weights.items()}
        self.norm = w["model.norm.weight"]
        tied = cfg.tie_word_embeddings
        head = w["model.embed_tokens.weight" if tied else "lm_head.weight"]
        self.lm_head = packed(head, dtype, self.device) if isinstance(head, QuantizedTensor) \
            else head
        # a tied quantized head's dense copy is the embedding: one copy, not two
        # (the head keeps it: only layer weights trade theirs for a packed one)
        head_dense = self.lm_head.dense if isinstance(self.lm_head, QuantizedLinear) else None
        self.embed = head_dense if tied and head_dense is not None \
            else dense(w["model.embed_tokens.weight"], dtype, self.device)
        if tied and not isinstance(self.lm_head, QuantizedLinear):
            self.lm_head = self.embed
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            # q, k and v as one matmul: one GEMM instead of three
            qkv = fuse([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]],
                       dtype, self.device)
            bias = torch.cat([w[a + f"{x}_proj.bias"] for x in "qkv"]) \
                if cfg.attention_bias else None
            gate_up = fuse([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], dtype,
                           self.device)
            self.layers.append((*self.slots[i], w[p + "input_layernorm.weight"], qkv, bias,  # type: ignore[misc]
                                fuse([w[a + "o_proj.weight"]], dtype, self.device),
                                w[p + "post_attention_layernorm.weight"], gate_up,
                                fuse([w[p + "mlp.down_proj.weight"]], dtype, self.device)))
        self.rotary = Rotary(cfg, dtype, self.device)
        self.lora: LoraStacks | None = None
        self.quantized = bool(quantized_linears(self))
        # every row through one C call a layer, where it fits (cpu/layer.py)
        self.native_layers, self.native_layers_why = native_layers_for(self)
        # the norms, residual adds and SwiGLU: flashinfer's fused kernels on a
        # GPU, torch's elsewhere (fused_ops.py); a test may set another
        self.fused_ops: TorchOps
        self.fused_ops, self.fused_ops_why = choose_fused_ops(cfg, dtype, self.device)

    def enable_lora(self, slots: int, max_rank: int) -> LoraStacks:
        """Device stacks for `slots` LoRA adapters of rank up to `max_rank`;
        a forward given a LoraRound over them applies each row's adapter."""
        if self.tp is not None:
            raise TpError("LoRA adapters under tensor parallelism are not built (the "
                          "adapters' matrices are not sharded); use tensor_parallel_size 1 "
                          "with lora:")
        self.lora = LoraStacks(self.cfg, slots, max_rank, self.dtype, self.device)
        return self.lora

    def _native_forward(self, h, metas: list, caches: list, logits_indices) -> torch.Tensor | None:
        """Every row through pdserve's C layers (cpu/layer.py), where they
        serve this round: its logits, or None (torch's path runs it)."""
        if self.native_layers is None or self.lora is not None or self.tp is not None or \
                len(metas) != 1 or not metas[0].seqs or torch.compiler.is_compiling():
            return None
        out = self.native_layers.run(h, metas[0], [caches[layer[0]].layer(layer[1])
                                                   for layer in self.layers])
        if out is None:
            return None
        h = rms_norm(out[logits_indices].to(h.dtype), self.norm, self.cfg.rms_norm_eps)
        # a prompt's logits rows (first in row order) through the head's dense copy
        prompt = int((logits_indices < metas[0].prefill_rows()).sum())
        return self.head(h, prompt).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta | list, cache: KVCache | list,
                logits_indices: torch.Tensor, lora: BatchedLora | None = None) -> torch.Tensor:
        """Logits (float32) for the rows in `logits_indices`. `meta` and
        `cache`: one per cache group (or, single-group, one of each). `lora`:
        each row's adapter (None, or a round of base rows only: none)."""
        c = self.cfg
        if lora is not None and not lora.active:
            lora = None
        metas, caches = self.per_group(meta, cache)
        h = self.embed_rows(input_ids)
        if lora is None:
            native = self._native_forward(h, metas, caches, logits_indices)
            if native is not None:
                return native
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = self.rotary.at(metas[0].positions)
        heads = c.num_heads + c.num_kv_heads
        # quantized weights: prefill rows through the dense copies (kernels/cpu/quantized.py)
        dense_rows = metas[0].prefill_rows() if self.quantized else 0
        # the residual stream through ops.add_rms_norm (fused_ops.py: one
        # kernel with flashinfer's, in place on tensors this forward made);
        # the MLP's output waits in `delta` for the next layer's first norm
        ops = self.fused_ops
        delta = None
        for i, (g, j, ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w) in enumerate(self.layers):
            if not h.shape[0]:
                break
            if delta is None:
                x = ops.rms_norm(h, ln1, c.rms_norm_eps)
            else:
                x, h = ops.add_rms_norm(delta, h, ln1, c.rms_norm_eps)
            qkv = linear(x, qkv_w, qkv_b, dense_rows=dense_rows)
            if lora is not None:
                qkv = lora.add(i, QKV, x, qkv)
            # q and k rotate together: one pass over [tokens, heads + kv_heads, d]
            qk = self.rotary.apply(qkv[:, :q_dim + kv_dim].view(-1, heads, c.head_dim), cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, q_dim + kv_dim:].reshape(-1, c.num_kv_heads, c.head_dim)
            k_pages, v_pages = caches[g].layer(j)
            o = self.attention.forward(q, k, v, k_pages, v_pages, metas[g])
            o = o.reshape(-1, q_dim)
            attended = self.reduce(linear(o, o_w, dense_rows=dense_rows) if lora is None
                                   else lora.add(i, O, o, linear(o, o_w, dense_rows=dense_rows)))
            x, h = ops.add_rms_norm(attended, h, ln2, c.rms_norm_eps)
            gu = linear(x, gate_up_w, dense_rows=dense_rows)
            if lora is not None:
                gu = lora.add(i, GATE_UP, x, gu)
            act = ops.silu_and_mul(gu)
            down = linear(act, down_w, dense_rows=dense_rows)
            delta = self.reduce(down if lora is None else lora.add(i, DOWN, act, down))
        if delta is not None:
            h = h + delta
        h = ops.rms_norm(h[logits_indices], self.norm, c.rms_norm_eps)
        # the logits rows are in row order: a prefill's come before every decode's
        return self.head(h, int((logits_indices < dense_rows).sum()) if dense_rows else 0).float()
