"""A roofline cost model for one engine round, from model and GPU presets.

A round's time is the larger of its compute time and its memory time, plus
a fixed launch overhead:
  compute = 2 * params * tokens  +  attention (4 * layers * q_dim * query x key pairs)
  memory  = weight bytes once    +  KV bytes the attention reads and writes
each divided by the GPU's peak and an achieved fraction of it. The default
fractions come from ../shared/data/perf (DistServe's A100 profile of
OPT-13B): its prefill slope of 0.102 ms/token is ~80% of A100 bf16 peak, and
its small-batch decode floor of ~20 ms is ~65% of HBM bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.scheduler.config import ConfigError


@dataclass(frozen=True)
class GpuPreset:
    name: str
    flops: float            # dense bf16 FLOP/s
    mem_bw: float           # HBM bytes/s
    mfu: float = 0.75       # achieved fraction of flops in large GEMMs
    mbu: float = 0.65       # achieved fraction of bandwidth in decode
    overhead_s: float = 0.003  # per-round launch and scheduling cost
    pcie_bw: float = 25e9      # host <-> device copy bytes/s (L2 stores and loads)


@dataclass(frozen=True)
class ModelPreset:
    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


GPUS = {
    "h100": GpuPreset("h100", flops=989e12, mem_bw=3.35e12),
    "h200": GpuPreset("h200", flops=989e12, mem_bw=4.8e12),
    "a100": GpuPreset("a100", flops=312e12, mem_bw=2.039e12),
}

MODELS = {
    # Llama 3.1 8B: 128K context
    "llama-3-8b": ModelPreset("llama-3-8b", 8.03e9, 32, 32, 8, 128, 131072),
    "llama-3-70b": ModelPreset("llama-3-70b", 70.6e9, 80, 64, 8, 128, 131072),
    "opt-13b": ModelPreset("opt-13b", 12.9e9, 40, 40, 40, 128, 2048),
    # the embedded tiny model (kernels' preset: tiny), for quick simulations
    "tiny": ModelPreset("tiny", 2.0e6, 2, 4, 2, 16, 4096, dtype_bytes=4),
}


def preset(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise ConfigError(
            f"unknown simulate.{kind} {name!r}; choose one of: {', '.join(sorted(table))}"
        ) from None


class CostModel:
    def __init__(self, model: ModelPreset, gpu: GpuPreset):
        self.model, self.gpu = model, gpu
        self._flops = gpu.flops * gpu.mfu
        self._bw = gpu.mem_bw * gpu.mbu
        self._weight_bytes = model.params * model.dtype_bytes
        self._attn = 4 * model.layers * model.q_heads * model.head_dim
        self._kvb = model.kv_bytes_per_token

    def round_seconds(self, prefills, decode_contexts: int, num_decodes: int) -> float:
        """`prefills`: (begin, tokens) per chunk; `decode_contexts`: the sum
        of context lengths the decodes attend over."""
        tokens = num_decodes
        pairs = decode_contexts
        kv = decode_contexts
        for begin, n in prefills:
            tokens += n
            pairs += n * (begin + (n + 1) / 2)
            kv += begin + n
        if tokens == 0:
            return 0.0
        compute = (2 * self.model.params * tokens + self._attn * pairs) / self._flops
        memory = (self._weight_bytes + self._kvb * kv) / self._bw
        return max(compute, memory) + self.gpu.overhead_s

    def copy_seconds(self, tokens: int) -> float:
        """Host <-> device time for `tokens` tokens of KV."""
        return tokens * self._kvb / self.gpu.pcie_bw if tokens else 0.0
