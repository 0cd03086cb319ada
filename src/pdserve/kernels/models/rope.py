"""Rotary position embeddings, with the scaling variants Hugging Face
checkpoints declare (`rope_scaling`): default, linear, dynamic, llama3, yarn."""

from __future__ import annotations

import math

import torch

from pdserve.kernels.models.model_config import ModelConfig, ModelError
from pdserve.kernels.models.moe.specs import yarn_mscale


def inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32) and the attention scaling factor."""
    d = cfg.head_dim
    base = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    freq = 1.0 / (cfg.rope_theta ** base)
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return freq, 1.0
    if kind == "linear":
        return freq / sc["factor"], 1.0
    if kind == "dynamic":
        # the static form at the model's own context: identical to default there
        return freq, 1.0
    if kind == "llama3":
        factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wl = 2 * math.pi / freq
        scaled = torch.where(wl > low_wl, freq / factor, freq)
        smooth = (old / wl - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wl < high_wl) & ~(wl > low_wl)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        return _yarn(sc, cfg.rope_theta, d, cfg.max_position)
    raise ModelError(f"rope_scaling type {kind!r} is not supported; pdserve supports "
                     "default, linear, dynamic, llama3 and yarn")


def _yarn(sc: dict, theta: float, d: int, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek-V3's long context): the low frequencies interpolated by
    `factor`, the high ones kept, a linear ramp between the dims that turn
    beta_fast and beta_slow times over the original context; cos and sin
    scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    old = sc["original_max_position_embeddings"]
    factor = sc.get("factor") or max_position / old
    mscale, mscale_all = sc.get("mscale"), sc.get("mscale_all_dim")
    attention = sc.get("attention_factor")
    if attention is None:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) \
            if mscale and mscale_all else yarn_mscale(factor)

    def dim_of(turns: float) -> float:      # the dim that turns `turns` times over `old`
        return d * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(sc.get("beta_fast") or 32), dim_of(sc.get("beta_slow") or 1)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                     # 1: extrapolated (kept), 0: interpolated
    pos = theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    return 1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep, float(attention)


class Rotary:
    """cos/sin tables for every position up to the model's context. The sin
    table's first half is stored negated, so that rotating half a head is a
    roll: x * cos + roll(x) * sin gives (x1 cos - x2 sin, x2 cos + x1 sin)
    in four torch calls where cat(-x2, x1) took seven; the products are the
    same numbers (negation is exact), so the result is bit for bit."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        freq, scale = inv_freq(cfg)
        pos = torch.arange(cfg.max_position, dtype=torch.float32)
        angles = torch.outer(pos, freq)
        emb = torch.cat((angles, angles), dim=-1)
        sign = torch.cat((-torch.ones_like(freq), torch.ones_like(freq)))
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale * sign).to(dtype=dtype, device=device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's cos and (signed) sin rows, [tokens, 1, head_dim]:
        looked up once, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; cos, sin from `at`."""
        return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin
