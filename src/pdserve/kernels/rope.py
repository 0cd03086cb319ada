"""Rotary position embeddings, with the scaling variants Hugging Face
checkpoints declare (`rope_scaling`): default, linear, dynamic, llama3."""

from __future__ import annotations

import math

import torch

from pdserve.kernels.model_config import ModelConfig, ModelError


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
    raise ModelError(f"rope_scaling type {kind!r} is not supported; pdserve supports "
                     "default, linear, dynamic and llama3")


class Rotary:
    """cos/sin tables for every position up to the model's context."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device):
        freq, scale = inv_freq(cfg)
        pos = torch.arange(cfg.max_position, dtype=torch.float32)
        angles = torch.outer(pos, freq)
        emb = torch.cat((angles, angles), dim=-1)
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The round's cos and sin rows, [tokens, 1, head_dim]: looked up once,
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; cos, sin from `at`."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
