"""A Llama-family decoder over a paged KV cache: RMSNorm, rotary positions,
grouped-query attention, SwiGLU; Qwen2's q/k/v biases and Mistral's sliding
window where they differ. Weights use Hugging Face's names, so a checkpoint's
safetensors load as they are."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta, KVCache
from pdserve.kernels.model_config import ModelConfig
from pdserve.kernels.rope import Rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def weight_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        for proj in ("q", "k", "v", "o"):
            names.append(f"{p}self_attn.{proj}_proj.weight")
        if cfg.attention_bias:
            names += [f"{p}self_attn.{proj}_proj.bias" for proj in ("q", "k", "v")]
        names += [f"{p}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    return names


def random_weights(cfg: ModelConfig, seed: int, dtype=torch.float32) -> dict:
    """Seeded weights (the tiny preset): the same on every machine."""
    g = torch.Generator().manual_seed(seed)
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
    out = {}
    for name in weight_names(cfg):
        if name.endswith("norm.weight"):
            out[name] = torch.ones(cfg.hidden_size, dtype=dtype)
            continue
        key = name.split(".")[-2]
        if name.endswith(".bias"):
            shape = (shapes[key][0],)
        else:
            shape = shapes[key]
        out[name] = (torch.randn(shape, generator=g) * 0.5 / shape[-1] ** 0.5).to(dtype)
    return out


class DecoderModel:
    def __init__(self, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device,
                 attention):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        w = {k: v.to(dtype=dtype, device=self.device) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            # q, k and v as one matmul: one GEMM instead of three
            qkv = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"],
                             w[a + "v_proj.weight"]])
            bias = torch.cat([w[a + f"{x}_proj.bias"] for x in "qkv"]) \
                if cfg.attention_bias else None
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
            self.layers.append((w[p + "input_layernorm.weight"], qkv, bias,
                                w[a + "o_proj.weight"], w[p + "post_attention_layernorm.weight"],
                                gate_up, w[p + "mlp.down_proj.weight"]))
        self.rotary = Rotary(cfg, dtype, self.device)
        self.attention = attention

    def new_cache(self, pages: int, page_size: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, pages, page_size, c.num_kv_heads, c.head_dim,
                       self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta, cache: KVCache,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits (float32) for the rows in `logits_indices`."""
        c = self.cfg
        h = self.embed[input_ids]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        cos, sin = self.rotary.at(meta.positions)
        heads = c.num_heads + c.num_kv_heads
        for i, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w) in enumerate(self.layers):
            x = rms_norm(h, ln1, c.rms_norm_eps)
            qkv = F.linear(x, qkv_w, qkv_b)
            # q and k rotate together: one pass over [tokens, heads + kv_heads, d]
            qk = self.rotary.apply(qkv[:, :q_dim + kv_dim].view(-1, heads, c.head_dim), cos, sin)
            q, k = qk[:, :c.num_heads], qk[:, c.num_heads:]
            v = qkv[:, q_dim + kv_dim:].reshape(-1, c.num_kv_heads, c.head_dim)
            k_pages, v_pages = cache.layer(i)
            o = self.attention.forward(q, k, v, k_pages, v_pages, meta)
            h = h + F.linear(o.reshape(-1, q_dim), o_w)
            x = rms_norm(h, ln2, c.rms_norm_eps)
            gu = F.linear(x, gate_up_w)
            inter = gu.shape[-1] // 2
            h = h + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down_w)
        h = rms_norm(h[logits_indices], self.norm, c.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
