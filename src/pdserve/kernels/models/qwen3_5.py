"""Qwen3.5 text (Qwen3_5ForCausalLM): Gated DeltaNet layers beside full
attention ones, three to one in the released checkpoints.

The attention layers' K/V go in one full-history cache group, paged as in
model.py; the Gated DeltaNet layers (gated_delta.py) keep a state per
sequence in a StateCache, and a round's StateBatch says which slot each
sequence starts from and where its state goes. Where the attention layers
differ from the Llama family: q_proj yields each head's query and an output
gate side by side, and the attention output is multiplied by sigmoid(gate)
before o_proj; q and k are RMS-normed per head; rotary positions turn only
the first head_dim * partial_rotary_factor dims. Every RMSNorm but the
DeltaNet's output norm scales by (1 + weight) in float32, as Gemma's do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta
from pdserve.kernels.models.gated_delta import GatedDeltaNet
from pdserve.kernels.models.gemma3 import gemma_norm
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.models.model import HybridLayer, PagedDecoder
from pdserve.kernels.models.model_config import ModelConfig, ModelError
from pdserve.kernels.models.rope import Rotary
from pdserve.kernels.models.state_cache import StateBatch

GDN_WEIGHTS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
               "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")


def qwen3_5_weight_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    state = set(cfg.state_layers())
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if i in state:
            names += [f"{p}linear_attn.{n}" for n in GDN_WEIGHTS]
        else:
            names += [f"{p}self_attn.{proj}_proj.weight" for proj in "qkvo"]
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
            if cfg.attention_bias:
                names += [f"{p}self_attn.{proj}_proj.bias" for proj in "qkv"]
        names += [f"{p}mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    return names


@dataclass
class _Attention:
    group: int                  # its cache group and its layer there
    slot: int
    qkv: torch.Tensor           # q (with the gate), k and v projections as one
    bias: torch.Tensor | None
    qk_scale: torch.Tensor      # 1 + q_norm per query head, 1 + k_norm per KV head
    o_proj: torch.Tensor



class Qwen3_5Model(PagedDecoder):
    def __init__(self, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device, attention):
        super().__init__(cfg, dtype, device, attention)
        if cfg.linear_num_value_heads % max(cfg.linear_num_key_heads, 1):
            raise ModelError(f"linear_num_value_heads {cfg.linear_num_value_heads} is not a "
                             f"multiple of linear_num_key_heads {cfg.linear_num_key_heads}")
        dev = self.device
        # only the text model's tensors: a checkpoint may carry others (mtp.*)
        w = {k: weights[k].to(dtype=dtype, device=dev) for k in qwen3_5_weight_names(cfg)}

        def scale(name):                    # (1 + weight) in float32, from the dtype's weight
            return 1.0 + w[name].float()

        self.embed = w["model.embed_tokens.weight"]
        self.norm = scale("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        state_index = {layer: j for j, layer in enumerate(cfg.state_layers())}
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            if i in state_index:
                mixer = GatedDeltaNet(cfg, w, p + "linear_attn.")
            else:
                mixer = self._attention_weights(w, p + "self_attn.", scale, *self.slots[i])  # type: ignore[assignment, misc]
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
            self.layers.append(HybridLayer(scale(p + "input_layernorm.weight"), mixer,
                                           state_index.get(i),
                                           scale(p + "post_attention_layernorm.weight"), gate_up,
                                           w[p + "mlp.down_proj.weight"]))
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = Rotary(dataclasses.replace(cfg, head_dim=self.rotary_dim), dtype, dev)

    def _attention_weights(self, w, a, scale, group, slot) -> _Attention:
        c = self.cfg
        bias = torch.cat([w[a + f"{x}_proj.bias"] for x in "qkv"]) if c.attention_bias else None
        return _Attention(group, slot,
                          torch.cat([w[a + f"{x}_proj.weight"] for x in "qkv"]), bias,
                          torch.cat([scale(a + "q_norm.weight").expand(c.num_heads, -1),
                                     scale(a + "k_norm.weight").expand(c.num_kv_heads, -1)]),
                          w[a + "o_proj.weight"])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta | list, cache: KVCache | list,
                logits_indices: torch.Tensor, states: StateBatch | None = None) -> torch.Tensor:
        """Logits (float32) for the rows in `logits_indices`. `meta` and
        `cache`: the attention layers' one cache group. `states`: where each
        sequence's DeltaNet state comes from and goes (None: whole fresh
        prompts whose state is not kept)."""
        return self.hybrid_forward(input_ids, meta, cache, logits_indices, states, gemma_norm)

    def _attend(self, a: _Attention, x, metas, caches, rope) -> torch.Tensor:
        """Gated full attention: o_proj(attention * sigmoid(gate))."""
        c = self.cfg
        d, h, kvh = c.head_dim, c.num_heads, c.num_kv_heads
        T = x.shape[0]
        proj = F.linear(x, a.qkv, a.bias)
        q_gate = proj[:, :2 * h * d].view(T, h, 2 * d)          # per head: query, then gate
        k = proj[:, 2 * h * d:(2 * h + kvh) * d].view(T, kvh, d)
        v = proj[:, (2 * h + kvh) * d:].reshape(T, kvh, d)
        qk = gemma_norm(torch.cat([q_gate[..., :d], k], dim=1), a.qk_scale, c.rms_norm_eps)
        r = self.rotary_dim
        qk = torch.cat([self.rotary.apply(qk[..., :r], *rope), qk[..., r:]], dim=-1)
        k_pages, v_pages = caches[a.group].layer(a.slot)
        o = self.attention.forward(qk[:, :h], qk[:, h:], v, k_pages, v_pages, metas[a.group])
        o = o.reshape(T, h * d) * torch.sigmoid(q_gate[..., d:].reshape(T, h * d))
        return F.linear(o, a.o_proj)
