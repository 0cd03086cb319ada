"""Qwen3-MoE (Qwen3MoeForCausalLM) over a paged KV cache.

Attention is the Llama family's grouped-query attention with Qwen3's
per-head RMSNorm of q and k before rotation (NeoX-style rotary); the MLP of
a sparse layer is its experts (experts.py), of the others (mlp_only_layers,
decoder_sparse_step) a dense gated SiLU MLP. No shared expert, no bias in
the router, no scale on the routed sum. One full-history cache group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.models.model import PagedDecoder, rms_norm
from pdserve.kernels.models.model_config import ModelConfig
from pdserve.kernels.models.moe.experts import (DenseMlp, Experts, expert_weight_names, moe_mlp,
                                                use_experts_path)
from pdserve.kernels.models.rope import Rotary


def qwen3_moe_weight_names(cfg: ModelConfig) -> list[str]:
    assert cfg.moe is not None
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{proj}_proj.weight" for proj in "qkvo"]
        names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        if cfg.moe.is_sparse(i):
            names += [p + "mlp.gate.weight", *expert_weight_names(p, cfg.moe.num_experts)]
        else:
            names += [f"{p}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    return names


@dataclass
class _Layer:
    group: int                  # its cache group and its layer there
    slot: int
    ln_in: torch.Tensor
    qkv: torch.Tensor           # q, k and v projections as one
    qk_norm: torch.Tensor       # q_norm for each query head, k_norm for each KV head
    o_proj: torch.Tensor
    ln_post: torch.Tensor
    mlp: DenseMlp | Experts


class Qwen3MoeModel(PagedDecoder):
    def __init__(self, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device, attention):
        super().__init__(cfg, dtype, device, attention)
        assert cfg.moe is not None
        dev = self.device
        w = {k: weights[k].to(dtype=dtype, device=dev) for k in qwen3_moe_weight_names(cfg)
             if k in weights}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        mine = cfg.moe.local()
        h, kvh = cfg.num_heads, cfg.num_kv_heads
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            group, slot = self.slots[i]
            self.layers.append(_Layer(
                group, slot, w[p + "input_layernorm.weight"],
                torch.cat([w[a + f"{x}_proj.weight"] for x in "qkv"]),
                torch.cat([w[a + "q_norm.weight"].expand(h, -1),
                           w[a + "k_norm.weight"].expand(kvh, -1)]),
                w[a + "o_proj.weight"], w[p + "post_attention_layernorm.weight"],
                moe_mlp(cfg, w, i, mine)))
        self.rotary = Rotary(cfg, dtype, dev)
        self.experts_why = use_experts_path(self.expert_layers(), dev, dtype)

    def expert_layers(self) -> list[Experts]:
        """The sparse layers' experts, in layer order (their `counts`)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, Experts)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta | list, cache: KVCache | list,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for the rows in `logits_indices`."""
        c = self.cfg
        eps, d, h, kvh = c.rms_norm_eps, c.head_dim, c.num_heads, c.num_kv_heads
        metas, caches = self.per_group(meta, cache)
        x_rows = self.embed_rows(input_ids)
        cos, sin = self.rotary.at(metas[0].positions)
        for layer in self.layers:
            x = rms_norm(x_rows, layer.ln_in, eps)
            qkv = F.linear(x, layer.qkv)
            qk = rms_norm(qkv[:, :(h + kvh) * d].view(-1, h + kvh, d), layer.qk_norm, eps)
            qk = self.rotary.apply(qk, cos, sin)
            v = qkv[:, (h + kvh) * d:].reshape(-1, kvh, d)
            k_pages, v_pages = caches[layer.group].layer(layer.slot)
            o = self.attention.forward(qk[:, :h], qk[:, h:], v, k_pages, v_pages,
                                       metas[layer.group])
            x_rows = x_rows + self.reduce(F.linear(o.reshape(-1, h * d), layer.o_proj))
            x = rms_norm(x_rows, layer.ln_post, eps)
            x_rows = x_rows + self.reduce(layer.mlp.forward(x))
        x = rms_norm(x_rows[logits_indices], self.norm, eps)
        return self.head(x).float()
