"""DeepSeek-V3 (DeepseekV3ForCausalLM) over a cache of latent pages.

Each layer attends through multi-head latent attention (mla.py): queries
from a low-rank pair (q_a_proj, its norm, q_b_proj), and per token one
latent (kv_a_proj_with_mqa's first kv_lora_rank outputs, normed) and one
rotary key (its last qk_rope_head_dim, rotated), which is all the cache
keeps. The first first_k_dense_replace layers have a dense MLP; the others
are experts (experts.py) with DeepSeek's router (sigmoid scores, a
correction bias for the choice, the best topk_group of n_group groups,
the routed sum times routed_scaling_factor) and a shared expert every
token runs. The multi-token-prediction layer (model.layers.61 in the
released checkpoint) is not read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.models.model import PagedDecoder, rms_norm
from pdserve.kernels.models.model_config import ModelConfig
from pdserve.kernels.models.moe.experts import (DenseMlp, Experts, expert_weight_names, moe_mlp,
                                                use_experts_path)
from pdserve.kernels.models.moe.mla import (MlaAttention, MlaWeights, choose_mla_decode,
                                            mla_weights)
from pdserve.kernels.models.rope import Rotary

MLA_WEIGHTS = ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight",
               "o_proj.weight")


def deepseek_v3_weight_names(cfg: ModelConfig) -> list[str]:
    assert cfg.moe is not None and cfg.mla is not None
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    q = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight") \
        if cfg.mla.q_lora_rank else ("q_proj.weight",)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{n}" for n in (*q, *MLA_WEIGHTS)]
        if cfg.moe.is_sparse(i):
            names += [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias",
                      *expert_weight_names(p, cfg.moe.num_experts)]
            if cfg.moe.shared_intermediate:
                names += [f"{p}mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")]
        else:
            names += [f"{p}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    return names


@dataclass
class _Layer:
    group: int
    slot: int
    ln_in: torch.Tensor
    attn: MlaWeights
    ln_post: torch.Tensor
    mlp: DenseMlp | Experts


class DeepseekV3Model(PagedDecoder):
    def __init__(self, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device, attention):
        """`attention` (the engine's K/V backend) is not used: latent
        attention runs `MlaAttention`. Under TP, `cfg` is the rank's: its
        heads, and its experts (`moe.local()`) or their slices."""
        super().__init__(cfg, dtype, device, attention)
        assert cfg.moe is not None and cfg.mla is not None
        dev, spec = self.device, cfg.mla
        names = deepseek_v3_weight_names(cfg)
        w = {k: weights[k].to(dtype=dtype, device=dev) for k in names if k in weights}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        mine = cfg.moe.local()
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            group, slot = self.slots[i]
            self.layers.append(_Layer(group, slot, w[p + "input_layernorm.weight"],
                                      mla_weights(spec, w, p + "self_attn.", cfg.num_heads),
                                      w[p + "post_attention_layernorm.weight"],
                                      self._mlp(w, weights, i, mine)))
        # the decode rows' attention: flashinfer's MLA kernel on a GPU where it
        # has one for these shapes, torch's elsewhere (mla.py)
        decode, self.mla_decode_why = choose_mla_decode(spec, cfg.num_heads, dtype, dev)
        self.mla = MlaAttention(spec, cfg.num_heads, decode=decode)
        # rotary over the rope dims only (the checkpoint's config calls that head_dim)
        self.rotary = Rotary(dataclasses.replace(cfg, head_dim=spec.qk_rope_head_dim), dtype, dev)
        self.experts_why = use_experts_path(self.expert_layers(), dev, dtype)

    def _mlp(self, w: dict, weights: dict, i: int, mine: range) -> DenseMlp | Experts:
        """Layer i's MLP; a sparse one's router and bias in float32 from the
        checkpoint's own tensors (transformers keeps them float32)."""
        assert self.cfg.moe is not None
        if not self.cfg.moe.is_sparse(i):
            return moe_mlp(self.cfg, w, i, mine)
        g = f"model.layers.{i}.mlp."
        shared = DenseMlp(torch.cat([w[g + "shared_experts.gate_proj.weight"],
                                     w[g + "shared_experts.up_proj.weight"]]),
                          w[g + "shared_experts.down_proj.weight"]) \
            if self.cfg.moe.shared_intermediate else None
        return moe_mlp(self.cfg, w, i, mine,
                       router=weights[g + "gate.weight"].to(self.device, torch.float32),
                       bias=weights[g + "gate.e_score_correction_bias"].to(self.device,
                                                                           torch.float32),
                       shared=shared)

    def expert_layers(self) -> list[Experts]:
        """The sparse layers' experts, in layer order (their `counts`)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, Experts)]

    def _attend(self, a: MlaWeights, x, meta: BatchMeta, pages, rope) -> torch.Tensor:
        c, spec = self.cfg, self.cfg.mla
        assert spec is not None
        T, h = x.shape[0], c.num_heads
        q_in = x if a.q_a is None or a.q_a_norm is None else \
            rms_norm(F.linear(x, a.q_a), a.q_a_norm, c.rms_norm_eps)
        q = F.linear(q_in, a.q_b).view(T, h, spec.qk_head_dim)
        kv = F.linear(x, a.kv_a)
        latent = rms_norm(kv[:, :spec.kv_lora_rank], a.kv_a_norm, c.rms_norm_eps)
        k_pe = self.rotary.apply(kv[:, None, spec.kv_lora_rank:], *rope)[:, 0]
        q_pe = self.rotary.apply(q[..., spec.qk_nope_head_dim:], *rope)
        o = self.mla.forward(q[..., :spec.qk_nope_head_dim], q_pe, torch.cat([latent, k_pe], 1),
                             pages, meta, a)
        return F.linear(o.reshape(T, h * spec.v_head_dim), a.o_proj)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta | list, cache: KVCache | list,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for the rows in `logits_indices`."""
        c = self.cfg
        eps = c.rms_norm_eps
        metas, caches = self.per_group(meta, cache)
        h = self.embed_rows(input_ids)
        rope = self.rotary.at(metas[0].positions)
        for layer in self.layers:
            pages, _ = caches[layer.group].layer(layer.slot)
            x = rms_norm(h, layer.ln_in, eps)
            h = h + self.reduce(self._attend(layer.attn, x, metas[layer.group], pages, rope))
            h = h + self.reduce(layer.mlp.forward(rms_norm(h, layer.ln_post, eps)))
        return self.head(rms_norm(h[logits_indices], self.norm, eps)).float()
