"""Gemma 3 text (Gemma3ForCausalLM) over paged KV caches.

Where it differs from the Llama family (model.py): local layers with a
sliding window interleave with global ones, each kind rotating with its own
RoPE base (and scaling); q and k are RMS-normed per head before rotation;
every norm scales by (1 + weight), in float32; the attention output and the
MLP output are normed again before joining the residual; the MLP's gate is
tanh-approximated GELU; embeddings are scaled by sqrt(hidden_size), rounded
to the model dtype as the reference does; the attention scale is
query_pre_attn_scalar ** -0.5; attention scores and final logits may be
tanh-capped. Local and global layers fall into two cache groups
(`ModelConfig.cache_groups`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.models.model import PagedDecoder
from pdserve.kernels.models.model_config import ModelConfig
from pdserve.kernels.models.rope import Rotary

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
         "post_feedforward_layernorm")


def gemma_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm times `scale` (= 1 + weight, float32), rounded once, at the end."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def gemma3_weight_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [f"{p}{n}.weight" for n in NORMS]
        names += [f"{p}self_attn.{proj}_proj.weight" for proj in "qkvo"]
        names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
        if cfg.attention_bias:
            names += [f"{p}self_attn.{proj}_proj.bias" for proj in "qkv"]
        names += [f"{p}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    return names


class Gemma3Model(PagedDecoder):
    def __init__(self, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device,
                 attention):
        super().__init__(cfg, dtype, device, attention)
        dev = self.device
        w = {k: v.to(dtype=dtype, device=dev) for k, v in weights.items()}

        def scale(name):                    # (1 + weight) in float32, as every norm uses it
            return 1.0 + weights[name].to(device=dev, dtype=torch.float32)

        self.embed = w["model.embed_tokens.weight"]
        # sqrt(hidden_size) rounded to the dtype first (bfloat16: 48 -> 48, 55.43 -> 55.5)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=dev)
        self.norm = scale("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        h, kvh = cfg.num_heads, cfg.num_kv_heads
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([w[a + f"{x}_proj.weight"] for x in "qkv"])
            bias = torch.cat([w[a + f"{x}_proj.bias"] for x in "qkv"]) \
                if cfg.attention_bias else None
            # q_norm for each query head, k_norm for each KV head: one norm over both
            qk_scale = torch.cat([scale(a + "q_norm.weight").expand(h, -1),
                                  scale(a + "k_norm.weight").expand(kvh, -1)])
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
            local = cfg.layer_window(i) is not None
            self.layers.append((*self.slots[i], local, *(scale(p + n + ".weight") for n in NORMS),  # type: ignore[misc]
                                qkv, bias, qk_scale, w[a + "o_proj.weight"], gate_up,
                                w[p + "mlp.down_proj.weight"]))
        self.rotary = Rotary(cfg, dtype, dev)
        self.rotary_local = Rotary(dataclasses.replace(
            cfg, rope_theta=cfg.rope_local_theta, rope_scaling=cfg.rope_local_scaling), dtype, dev)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta | list, cache: KVCache | list,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for the rows in `logits_indices`; one BatchMeta
        and one KVCache per cache group."""
        c = self.cfg
        eps, d = c.rms_norm_eps, c.head_dim
        metas, caches = self.per_group(meta, cache)
        h = self.embed_rows(input_ids) * self.embed_scale
        q_dim, kv_dim = c.num_heads * d, c.num_kv_heads * d
        heads = c.num_heads + c.num_kv_heads
        rope = {False: self.rotary.at(metas[0].positions),
                True: self.rotary_local.at(metas[0].positions)}
        for g, j, local, ln_in, ln_post_attn, ln_pre_ff, ln_post_ff, qkv_w, qkv_b, qk_scale, \
                o_w, gate_up_w, down_w in self.layers:
            x = gemma_norm(h, ln_in, eps)
            qkv = F.linear(x, qkv_w, qkv_b)
            qk = gemma_norm(qkv[:, :q_dim + kv_dim].view(-1, heads, d), qk_scale, eps)
            qk = self.rotary.apply(qk, *rope[local])
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, q_dim + kv_dim:].reshape(-1, c.num_kv_heads, d)
            k_pages, v_pages = caches[g].layer(j)
            o = self.attention.forward(q, k, v, k_pages, v_pages, metas[g])
            h = h + gemma_norm(self.reduce(F.linear(o.reshape(-1, q_dim), o_w)), ln_post_attn, eps)
            x = gemma_norm(h, ln_pre_ff, eps)
            gu = F.linear(x, gate_up_w)
            inter = gu.shape[-1] // 2
            mlp = F.linear(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:], down_w)
            h = h + gemma_norm(self.reduce(mlp), ln_post_ff, eps)
        h = gemma_norm(h[logits_indices], self.norm, eps)
        logits = self.head(h).float()
        cap = c.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
