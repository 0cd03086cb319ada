"""Gated DeltaNet, the token mixer of Qwen3.5's linear-attention layers,
over a round's flat batch and its state slots.

Per value head h, the layer keeps a matrix S (key_dim x value_dim). Each
token first decays it by exp(g), with g = -exp(A_log) * softplus(a + dt_bias)
<= 0, then corrects what S predicts for its key toward its value at rate
beta = sigmoid(b) (the delta rule), then reads it with its query:

    S  <- exp(g) S
    u   = beta (v - S^T k)
    S  <- S + k u^T
    o   = S^T q

q, k and v come out of a causal depthwise conv (kernel K, SiLU) over the
projected tokens, whose K - 1 previous inputs are the rest of the state; q
and k are L2-normed and q scaled by key_dim ** -0.5; each q/k head serves
value_heads / key_heads consecutive value heads. The output is RMS-normed
per head, scaled by its weight, gated by SiLU(z), and projected back.

A prefill extent runs the chunked form (`chunked_delta_rule`): the rule
unrolled over chunks of 64 rows, a few matmuls and a triangular solve per
chunk, one sequential step per chunk. Decodes take one recurrent step each,
batched over the round's decoding sequences (`delta_rule_step`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.attention import BatchMeta
from pdserve.kernels.models.model_config import ModelConfig
from pdserve.kernels.models.state_cache import StateRound

CHUNK = 64      # rows per chunk: transformers' and flash-linear-attention's


def l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def depthwise_conv(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None):
    """One extent's causal depthwise conv, no activation: x [T, C] after
    `prev` [C, K - 1] (the inputs before it), `weight` [C, K]. Returns
    (conv [T, C], the inputs [C, K - 1 + T]: the state after row r is its
    columns [r, r + K - 1))."""
    window = torch.cat([prev, x.t()], dim=1)
    # K shifted multiply-adds rather than F.conv1d: a depthwise conv of a few
    # taps is memory-bound either way, and conv1d's threaded small-input path
    # cost 100x more on a loaded 2-core host. Summed in float32 and rounded
    # once, as conv1d accumulates.
    T, taps = x.shape[0], weight.shape[1]
    wf, xf = weight.float(), window.float()
    out = xf[:, :T] * wf[:, :1]
    for i in range(1, taps):
        out = out + xf[:, i:i + T] * wf[:, i:i + 1]
    if bias is not None:
        out = out + bias.float()[:, None]
    return out.to(x.dtype).t(), window


def causal_conv(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor):
    """A Gated DeltaNet extent's conv: SiLU(depthwise_conv) and the inputs."""
    out, window = depthwise_conv(x, prev, weight)
    return F.silu(out), window


def conv_step(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor):
    """One row per sequence: x [B, C], prev [B, C, K - 1]. Returns
    (SiLU(conv) [B, C], the new states [B, C, K - 1])."""
    window = torch.cat([prev, x[:, :, None]], dim=2)
    out = (window.float() * weight.float()).sum(-1).to(x.dtype)
    return F.silu(out), window[:, :, 1:]


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The delta rule over one extent, float32 throughout: q, k [T, H, Dk],
    v [T, H, Dv], g, beta [T, H], `state` [H, Dk, Dv] before the extent.
    Returns (o [T, H, Dv], the state after the extent).

    Within a chunk, with G_t the cumulative log decay from the chunk's start
    through row t and S0 the state before the chunk, row t's correction is
        u_t = beta_t v_t - beta_t e^{G_t} S0^T k_t
              - sum_{s<t} beta_t e^{G_t - G_s} (k_t . k_s) u_s,
    a unit lower-triangular system (I + A) U = beta V - (beta e^G K) S0,
    solved once for both right-hand sides before the chunks' sequential
    pass. Then o_t = e^{G_t} S0^T q_t + sum_{s<=t} e^{G_t - G_s} (q_t . k_s) u_s,
    and the state after the chunk is e^{G_c} S0 + sum_s e^{G_c - G_s} k_s u_s^T."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    c = min(chunk, T)
    n = -(-T // c)
    pad = n * c - T

    # head-major, padded to whole chunks: padded rows have k = v = beta = 0
    # and g = 0, so they write nothing and decay nothing
    def chunks(x):
        x = x.transpose(0, 1)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return x.reshape(H, n, c, *x.shape[2:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    logdecay = g.cumsum(-1)                                            # G: [H, n, c]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    pair = (logdecay[..., :, None] - logdecay[..., None, :]).masked_fill(~causal, float("-inf"))
    pair = pair.exp()                                                  # e^{G_t - G_s}, s <= t
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair     # its strict lower part is A
    rhs = torch.cat([v * beta[..., None], k_beta * logdecay.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_free, u_per_state = solved.split([dv, dk], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * pair
    q_decayed = q * logdecay.exp()[..., None]
    k_to_end = k * (logdecay[..., -1:] - logdecay).exp()[..., None]
    chunk_decay = logdecay[..., -1].exp()[..., None, None]             # [H, n, 1, 1]
    out = torch.empty(H, n, c, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        u = u_free[:, i] - u_per_state[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(H, n * c, dv)[:, :T].transpose(0, 1), state


def delta_rule_step(q, k, v, g, beta, state):
    """One row per sequence: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H],
    `state` [B, H, Dk, Dv]. Returns (o [B, H, Dv], the new states)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    u = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


class GatedDeltaNet:
    """One layer's weights (Hugging Face names under `prefix`, already in
    the model dtype) and its forward over a round."""

    def __init__(self, cfg: ModelConfig, w: dict, prefix: str):
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.eps = cfg.rms_norm_eps
        self.conv_dim = cfg.conv_dim
        # qkv, z, b and a as one matmul
        self.in_proj = torch.cat([w[f"{prefix}in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")])
        self.conv_w = w[prefix + "conv1d.weight"].squeeze(1)                # [C, K]
        # the decay's rate and bias in float32, from the model-dtype weights,
        # as the reference computes g
        self.neg_rate = -w[prefix + "A_log"].float().exp()
        self.dt_bias = w[prefix + "dt_bias"].float()
        self.norm = w[prefix + "norm.weight"]
        self.out_proj = w[prefix + "out_proj.weight"]

    def _heads(self, mixed: torch.Tensor):
        """Conv output [N, C] -> q, k [N, Hv, Dk] (normed, q scaled, each q/k
        head repeated for its value heads) and v [N, Hv, Dv], float32."""
        kd = self.hk * self.dk
        q, k, v = mixed.float().split([kd, kd, self.hv * self.dv], dim=-1)
        rep = self.hv // self.hk
        q = (l2_normed(q.reshape(-1, self.hk, self.dk)) * self.dk ** -0.5)
        k = l2_normed(k.reshape(-1, self.hk, self.dk))
        return (q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1),
                v.reshape(-1, self.hv, self.dv))

    def forward(self, x: torch.Tensor, meta: BatchMeta, states: StateRound,
                j: int) -> torch.Tensor:
        """x [T, hidden] (normed), the round's rows in BatchMeta order; state
        layer j's slots are read and written through `states`."""
        proj = F.linear(x, self.in_proj)
        vd = self.hv * self.dv
        qkv, z, b, a = proj.split([self.conv_dim, vd, self.hv, self.hv], dim=-1)
        beta = torch.sigmoid(b).float()
        g = self.neg_rate * F.softplus(a.float() + self.dt_bias)
        conv0, rec0 = states.read(j)
        out = torch.empty(x.shape[0], self.hv, self.dv, dtype=torch.float32, device=x.device)
        convs, recs, ckpt_conv, ckpt_rec = [], [], [], []
        n_pre = len(meta.seqs) - meta.num_decodes
        for i, s in enumerate(meta.seqs[:n_pre]):
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows], conv, rec, ckpt = self._extent(qkv[rows], g[rows], beta[rows], conv0[i],
                                                      rec0[i], states.checkpoint_rows.get(i))
            convs.append(conv)
            recs.append(rec)
            if ckpt:
                ckpt_conv.append(ckpt[0])
                ckpt_rec.append(ckpt[1])
        if meta.num_decodes:
            d0 = meta.seqs[n_pre].q_start
            mixed, conv1 = conv_step(qkv[d0:], conv0[n_pre:], self.conv_w)
            q, k, v = self._heads(mixed)
            out[d0:], rec1 = delta_rule_step(q, k, v, g[d0:], beta[d0:], rec0[n_pre:])
            convs.extend(conv1)
            recs.extend(rec1)
            for i in range(n_pre, len(meta.seqs)):
                if i in states.checkpoint_rows:            # after its one row: the final state
                    ckpt_conv.append(conv1[i - n_pre])
                    ckpt_rec.append(rec1[i - n_pre])
        states.write(j, torch.stack(convs), torch.stack(recs), ckpt_conv, ckpt_rec)
        return F.linear(self._gated_norm(out.to(x.dtype), z), self.out_proj)

    def _extent(self, qkv, g, beta, conv0, rec0, cut: int | None):
        """One prefill extent from its state (conv0, rec0): (o [T, Hv, Dv],
        the conv and recurrent states after it, and (conv, recurrent) after
        its first `cut` rows, or None). A checkpoint splits the extent in
        two, so the state after its rows is the rule's own, not derived."""
        T, width = qkv.shape[0], conv0.shape[-1]
        mixed, window = causal_conv(qkv, conv0, self.conv_w)
        q, k, v = self._heads(mixed)
        out = torch.empty(T, self.hv, self.dv, dtype=torch.float32, device=qkv.device)
        state, ckpt = rec0, None
        for lo, hi in ((0, cut), (cut, T)) if cut else ((0, T),):
            if hi > lo:
                out[lo:hi], state = chunked_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                                       beta[lo:hi], state)
            if hi == cut:
                ckpt = (window[:, cut:cut + width], state)
        return out, window[:, T:], state, ckpt

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm per value head (plain weight, not 1 + weight), rounded to
        the model dtype before the weight; then times SiLU(z) in float32."""
        T = o.shape[0]
        of = o.float()
        normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        gated = (self.norm * normed) * F.silu(z.reshape(T, self.hv, self.dv).float())
        return gated.to(o.dtype).reshape(T, -1)
