"""LFM2 (Lfm2ForCausalLM): short-conv layers beside full attention ones.

The attention layers' K/V go in one full-history cache group, paged as in
model.py, with each head's query and key RMS-normed before rotation. A conv
layer keeps only the last kernel - 1 inputs of a depthwise causal conv per
sequence: it projects the hidden state to B, C and x, convolves B * x, and
gates the result by C. That state lives in a StateCache slot like a Gated
DeltaNet layer's (with no recurrent part), so the planner's snapshot-state
group serves it unchanged: a round's StateBatch names each sequence's read,
final and checkpoint slot (spec §1.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta
from pdserve.kernels.models.gated_delta import depthwise_conv
from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.models.model import HybridLayer, PagedDecoder, rms_norm
from pdserve.kernels.models.model_config import ModelConfig
from pdserve.kernels.models.rope import Rotary
from pdserve.kernels.models.state_cache import StateBatch, StateRound


def lfm2_weight_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.embedding_norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    state = set(cfg.state_layers())
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "operator_norm.weight", p + "ffn_norm.weight"]
        if i in state:
            names += [f"{p}conv.{n}.weight" for n in ("in_proj", "conv", "out_proj")]
            if cfg.conv_bias:
                names += [f"{p}conv.{n}.bias" for n in ("in_proj", "conv", "out_proj")]
        else:
            names += [f"{p}self_attn.{n}.weight"
                      for n in ("q_proj", "k_proj", "v_proj", "out_proj", "q_layernorm",
                                "k_layernorm")]
        names += [f"{p}feed_forward.w{n}.weight" for n in (1, 2, 3)]
    return names


@dataclass
class _Conv:
    in_proj: torch.Tensor
    in_bias: torch.Tensor | None
    weight: torch.Tensor          # [C, K]
    bias: torch.Tensor | None
    out_proj: torch.Tensor
    out_bias: torch.Tensor | None

    def forward(self, x: torch.Tensor, meta: BatchMeta, states: StateRound,
                j: int) -> torch.Tensor:
        """x [T, hidden] (normed), the round's rows in BatchMeta order; state
        layer j's slots are read and written through `states`."""
        b, c, v = F.linear(x, self.in_proj, self.in_bias).chunk(3, dim=-1)
        bx = b * v
        conv0, rec0 = states.read(j)
        width = conv0.shape[-1]
        out = torch.empty_like(bx)
        convs, ckpts = [], []
        n_pre = len(meta.seqs) - meta.num_decodes
        for i, s in enumerate(meta.seqs[:n_pre]):
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows], window = depthwise_conv(bx[rows], conv0[i], self.weight, self.bias)
            convs.append(window[:, s.q_len:])
            cut = states.checkpoint_rows.get(i)
            if cut:
                ckpts.append((i, window[:, cut:cut + width]))
        if meta.num_decodes:
            d0 = meta.seqs[n_pre].q_start
            window = torch.cat([conv0[n_pre:], bx[d0:, :, None]], dim=2)
            y = (window.float() * self.weight.float()).sum(-1)
            if self.bias is not None:
                y = y + self.bias.float()
            out[d0:] = y.to(bx.dtype)
            for i in range(n_pre, len(meta.seqs)):
                convs.append(window[i - n_pre, :, 1:])
                if i in states.checkpoint_rows:      # after its one row: the final state
                    ckpts.append((i, window[i - n_pre, :, 1:]))
        # no recurrent state: its tensors have no elements, written as read
        states.write(j, torch.stack(convs), rec0, [cv for _, cv in ckpts],
                     [rec0[i] for i, _ in ckpts])
        return F.linear(c * out, self.out_proj, self.out_bias)


@dataclass
class _Attention:
    group: int
    slot: int
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    out_proj: torch.Tensor



class Lfm2Model(PagedDecoder):
    def __init__(self, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device, attention):
        super().__init__(cfg, dtype, device, attention)
        dev = self.device
        w = {k: weights[k].to(dtype=dtype, device=dev) for k in lfm2_weight_names(cfg)}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.embedding_norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        state_index = {layer: j for j, layer in enumerate(cfg.state_layers())}
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            if i in state_index:
                cp = p + "conv."
                bias = (lambda n: w[f"{cp}{n}.bias"]) if cfg.conv_bias else (lambda n: None)
                mixer = _Conv(w[cp + "in_proj.weight"], bias("in_proj"),
                              w[cp + "conv.weight"].squeeze(1), bias("conv"),
                              w[cp + "out_proj.weight"], bias("out_proj"))
            else:
                a = p + "self_attn."
                mixer = _Attention(*self.slots[i],  # type: ignore[assignment, call-arg, misc]
                                   torch.cat([w[a + f"{x}_proj.weight"] for x in "qkv"]),
                                   w[a + "q_layernorm.weight"], w[a + "k_layernorm.weight"],
                                   w[a + "out_proj.weight"])
            ff = p + "feed_forward."
            self.layers.append(HybridLayer(w[p + "operator_norm.weight"], mixer,
                                           state_index.get(i), w[p + "ffn_norm.weight"],
                                           torch.cat([w[ff + "w1.weight"], w[ff + "w3.weight"]]),
                                           w[ff + "w2.weight"]))
        self.rotary = Rotary(cfg, dtype, dev)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMeta | list, cache: KVCache | list,
                logits_indices: torch.Tensor, states: StateBatch | None = None) -> torch.Tensor:
        """Logits (float32) for the rows in `logits_indices`. `meta` and
        `cache`: the attention layers' one cache group. `states`: where each
        sequence's conv state comes from and goes (None: whole fresh prompts
        whose state is not kept)."""
        return self.hybrid_forward(input_ids, meta, cache, logits_indices, states, rms_norm)

    def _attend(self, a: _Attention, x, metas, caches, rope) -> torch.Tensor:
        c = self.cfg
        d, h, kvh = c.head_dim, c.num_heads, c.num_kv_heads
        T = x.shape[0]
        qkv = F.linear(x, a.qkv)
        q = rms_norm(qkv[:, :h * d].view(T, h, d), a.q_norm, c.rms_norm_eps)
        k = rms_norm(qkv[:, h * d:(h + kvh) * d].view(T, kvh, d), a.k_norm, c.rms_norm_eps)
        v = qkv[:, (h + kvh) * d:].reshape(T, kvh, d)
        qk = self.rotary.apply(torch.cat([q, k], dim=1), *rope)
        k_pages, v_pages = caches[a.group].layer(a.slot)
        o = self.attention.forward(qk[:, :h], qk[:, h:], v, k_pages, v_pages, metas[a.group])
        return F.linear(o.reshape(T, h * d), a.out_proj)
