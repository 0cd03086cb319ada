"""A roofline cost model for one engine round, from model and GPU presets.

A round's time is the larger of its compute time and its memory time, plus
a fixed launch overhead:
  compute = 2 * params * tokens  +  attention (4 * layers * q_dim * query x key pairs)
  memory  = weight bytes once    +  KV bytes the attention reads and writes
each divided by the GPU's peak and an achieved fraction of it. The default
fractions come from ../shared/data/perf (DistServe's A100 profile of
OPT-13B): its prefill slope of 0.102 ms/token is ~80% of A100 bf16 peak, and
its small-batch decode floor of ~20 ms is ~65% of HBM bandwidth.

A sliding-window layer (window W) is charged only what it reads: a query at
position p pairs with min(p + 1, W) keys, and a forward reads at most the
last W - 1 cached positions of such a layer. That holds whatever the cache
keeps: a deployment that keeps every layer's whole history (no sliding
groups) still computes attention over the window only. A mixture-of-experts
model computes with the parameters a token passes through (`active_params`)
and reads every weight each round (`weight_bytes`): at the batch sizes
serving runs, nearly every expert sees some token.

A state layer (Gated DeltaNet) keeps a fixed-size state per sequence
instead of K/V: it adds no attention pairs and no KV reads here. Its
recurrence is small next to its projections (in `params`), and the state it
reads and writes each round is not charged.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.scheduler.cache.groups import (FULL, FULL_HISTORY, SLIDING_WINDOW, SNAPSHOT_STATE,
                                            CacheGroupSpec)
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
    hbm_bytes: float = 0.0     # device memory (0: not stated)


@dataclass(frozen=True)
class ModelPreset:
    name: str
    params: float           # every parameter (an MoE's experts included)
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context: int
    dtype_bytes: int = 2    # KV cache (and, unless weight_bytes says, weights)
    sliding_layers: int = 0  # layers attending over a sliding window; the rest see everything
    window: int = 0          # their window, in tokens (the query itself included)
    active_params: float = 0.0  # MoE: parameters one token passes through (0: params)
    weight_bytes: float = 0.0   # bytes of weights read each round (0: params x dtype_bytes)
    state_layers: int = 0       # layers keeping a fixed-size state instead of K/V (Gated DeltaNet)
    state_bytes: int = 0        # one state slot: one sequence's state across every state layer
    # what a token keeps per layer and KV head: K and V (2), or latent
    # attention's one entry (1: kv_heads 1 of head_dim latent + rotary key)
    kv_parts: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.sliding_layers <= self.layers:
            raise ConfigError(f"model preset {self.name}: sliding_layers={self.sliding_layers} "
                              f"must be between 0 and layers={self.layers}")
        if (self.sliding_layers > 0) != (self.window > 0):
            raise ConfigError(f"model preset {self.name}: sliding layers need a window and a "
                              f"window needs sliding layers (sliding_layers="
                              f"{self.sliding_layers}, window={self.window})")
        if not 0 <= self.state_layers < self.layers:
            raise ConfigError(f"model preset {self.name}: state_layers={self.state_layers} must "
                              f"be between 0 and layers - 1 = {self.layers - 1} (a state group "
                              f"needs a full-attention group beside it)")
        if (self.state_layers > 0) != (self.state_bytes > 0):
            raise ConfigError(f"model preset {self.name}: state layers need state_bytes (one "
                              f"sequence's state across them) and state_bytes needs state layers "
                              f"(state_layers={self.state_layers}, "
                              f"state_bytes={self.state_bytes})")
        if self.state_layers and self.sliding_layers:
            raise ConfigError(f"model preset {self.name}: sliding and state layers together are "
                              f"not modelled; set sliding_layers or state_layers to 0")

    @property
    def full_layers(self) -> int:
        """Layers attending over the whole history (each keeps K/V)."""
        return self.layers - self.sliding_layers - self.state_layers

    @property
    def kv_layer_bytes(self) -> int:
        """KV bytes one token keeps in one layer (K and V, or MLA's latent entry)."""
        return self.kv_parts * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token keeps across every attention layer (full
        retention); a state layer keeps none."""
        return (self.layers - self.state_layers) * self.kv_layer_bytes

    @property
    def compute_params(self) -> float:
        return self.active_params or self.params

    @property
    def weight_bytes_total(self) -> float:
        return self.weight_bytes or self.params * self.dtype_bytes

    def _spread(self) -> tuple[tuple, tuple]:
        """(full-attention layer indices, the others). Full layers are
        spread evenly, each ending a run: every 6th layer of Gemma 3
        (5, 11, ..., 59), every 2nd of gpt-oss (1, 3, ..., 35), every 4th
        of Qwen3-Next (3, 7, ..., 47), which is where their configs'
        layer_types put them."""
        if self.full_layers == self.layers:
            return tuple(range(self.layers)), ()
        if not self.full_layers:
            return (), tuple(range(self.layers))
        step = self.layers // self.full_layers
        full = tuple((k + 1) * step - 1 for k in range(self.full_layers))
        return full, tuple(sorted(set(range(self.layers)) - set(full)))

    def layer_kinds(self) -> tuple[tuple, tuple]:
        """(full-attention layer indices, sliding-window ones); a state
        model's state layers are `state_layer_indices()`."""
        full, rest = self._spread()
        return full, rest if self.sliding_layers else ()

    def state_layer_indices(self) -> tuple:
        """The state layers' indices (none unless state_layers)."""
        return self._spread()[1] if self.state_layers else ()

    def groups(self, sliding: bool = True) -> list[CacheGroupSpec]:
        """The cache groups a planner serves this model with: full history
        first (if any layer has it), then the sliding-window layers, or a
        state model's snapshot-state group of its state layers, last. With
        `sliding=False`, one full-history group keeps every sliding layer's
        history (a hybrid allocator turned off)."""
        full, slide = self.layer_kinds()
        if self.state_layers:
            return [CacheGroupSpec(FULL_HISTORY, layers=full),
                    CacheGroupSpec(SNAPSHOT_STATE, layers=self.state_layer_indices())]
        if not slide or not sliding:
            return [FULL]
        out = [CacheGroupSpec(FULL_HISTORY, layers=full)] if full else []
        return out + [CacheGroupSpec(SLIDING_WINDOW, self.window, layers=slide)]

    def group_kv_bytes_per_token(self, groups) -> list[int]:
        """KV bytes one token keeps in each group: its layers x K and V x
        kv_heads x head_dim x dtype bytes. A group naming no layers holds
        every attention layer (the bare FULL group). A state group's cost
        is per slot, not per token (`state_bytes` a slot): 0 here."""
        return [0 if g.state else
                (len(g.layers) if g.layers else self.layers - self.state_layers)
                * self.kv_layer_bytes for g in groups]

    def group_page_bytes(self, groups, page_size: int) -> list[int]:
        """Bytes one page of each group holds, a state group's being one
        slot (`state_bytes`): what a host copy or a P -> D transfer moves."""
        return [self.state_bytes if g.state else b * page_size
                for g, b in zip(groups, self.group_kv_bytes_per_token(groups))]


def gdn_layer_state_bytes(key_heads: int, key_dim: int, value_heads: int, value_dim: int,
                          conv_kernel: int, state_dtype_bytes: int = 4,
                          conv_dtype_bytes: int = 2) -> int:
    """Bytes one Gated DeltaNet layer keeps for one sequence: the recurrent
    state (value_heads x key_dim x value_dim, fp32) and the conv state (the
    q, k and v channels, 2 x key_heads x key_dim + value_heads x value_dim,
    over the last conv_kernel - 1 inputs, in the model's dtype), the shapes
    vLLM keeps (shared/research/hybrid-cache.md §4.3)."""
    conv_channels = 2 * key_heads * key_dim + value_heads * value_dim
    return value_heads * key_dim * value_dim * state_dtype_bytes \
        + conv_channels * (conv_kernel - 1) * conv_dtype_bytes


GPUS = {
    "h100": GpuPreset("h100", flops=989e12, mem_bw=3.35e12, hbm_bytes=80e9),
    "h200": GpuPreset("h200", flops=989e12, mem_bw=4.8e12, hbm_bytes=141e9),
    "a100": GpuPreset("a100", flops=312e12, mem_bw=2.039e12, hbm_bytes=80e9),
}

MODELS = {
    # Llama 3.1 8B: 128K context
    "llama-3-8b": ModelPreset("llama-3-8b", 8.03e9, 32, 32, 8, 128, 131072),
    "llama-3-70b": ModelPreset("llama-3-70b", 70.6e9, 80, 64, 8, 128, 131072),
    "opt-13b": ModelPreset("opt-13b", 12.9e9, 40, 40, 40, 128, 2048),
    # the embedded tiny model (kernels' preset: tiny), for quick simulations
    "tiny": ModelPreset("tiny", 2.0e6, 2, 4, 2, 16, 4096, dtype_bytes=4),
    # Gemma 3 27B (google/gemma-3-27b; transformers' convert_gemma3_weights.py,
    # variant gemma3_27b; shared/research/hybrid-cache.md §5): 62 layers, 5
    # sliding (window 1024) to 1 global, so 52 + 10; 32 q heads, 16 KV heads
    # of 128. 27.4e9 parameters with the vision tower, 128K context, bf16.
    "gemma-3-27b": ModelPreset("gemma-3-27b", 27.4e9, 62, 32, 16, 128, 131072,
                               sliding_layers=52, window=1024),
    # gpt-oss-120b (openai/gpt-oss-120b config.json; transformers' GptOssConfig
    # defaults): 36 layers alternating sliding (window 128) and full, 64 q
    # heads, 8 KV heads of 64, 128K context (YaRN). MoE, 128 experts, top 4:
    # 116.8e9 parameters, 5.1e9 active per token. Its checkpoint keeps the
    # expert weights in MXFP4 (4.25 bits; ~114.7e9 parameters) and the rest
    # in bf16 (~2.2e9): ~65.2e9 bytes, the ~65 GB that fits one 80 GB GPU.
    # KV is bf16. Compute uses the active parameters, weight reads all of them.
    "gpt-oss-120b": ModelPreset("gpt-oss-120b", 116.8e9, 36, 64, 8, 64, 131072,
                                sliding_layers=18, window=128, active_params=5.1e9,
                                weight_bytes=65.2e9),
    # Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct config.json; the
    # sizing in shared/research/hybrid-cache.md §4.3): 48 layers, every 4th
    # full attention (full_attention_interval 4: 3, 7, ..., 47), the other 36
    # Gated DeltaNet. Attention: 16 q heads, 2 KV heads of 256. GDN: 16 key
    # heads and 32 value heads of 128, conv kernel 4, so a layer keeps a
    # 32 x 128 x 128 fp32 recurrent state (2 MiB) and a (2 x 16 x 128 +
    # 32 x 128 = 8192) x 3 bf16 conv state (48 KiB); one sequence's slot is
    # 36 x that = 73.7 MiB, what the notes give. MoE, 512 experts, top 10
    # plus a shared expert: ~80e9 parameters, ~3e9 active. 256K context, bf16.
    # Llama 3.1 405B (meta-llama/Llama-3.1-405B config.json): 126 layers, 128
    # q heads, 8 KV heads of 128, 128K context; the dense model nearest
    # DeepSeek-V3's size, for its bytes per token (docs/benchmarks.md)
    "llama-3-405b": ModelPreset("llama-3-405b", 405.8e9, 126, 128, 8, 128, 131072),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; shared/research/
    # moe-mla.md §1-2): 61 layers of multi-head latent attention, 128 heads;
    # the cache keeps one entry a token and layer, the 512-wide latent and
    # the 64-wide rotary key (kv_heads 1 of 576, one part): 1,152 bytes in
    # bf16, 68.6 KiB a token over 61 layers. Attention is charged
    # 4 x 128 x 576 FLOPs a query-key pair: absorbed decode's scores over
    # 576 dims and its sum over 512 (prefill's expanded 192/128 is less).
    # MoE: 256 routed experts top 8 + 1 shared, 671e9 parameters, 37e9
    # active; FP8 weights (1 byte each, block scales aside), bf16 KV.
    "deepseek-v3": ModelPreset("deepseek-v3", 671e9, 61, 128, 1, 576, 163840, kv_parts=1,
                               active_params=37e9, weight_bytes=671e9),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, 32 q heads, 4
    # KV heads of 128; 128 experts top 8, 30.5e9 parameters, 3.3e9 active; bf16.
    "qwen3-30b-a3b": ModelPreset("qwen3-30b-a3b", 30.5e9, 48, 32, 4, 128, 40960,
                                 active_params=3.3e9),
    "qwen3-next-80b": ModelPreset("qwen3-next-80b", 80e9, 48, 16, 2, 256, 262144,
                                  active_params=3e9, state_layers=36,
                                  state_bytes=36 * gdn_layer_state_bytes(16, 128, 32, 128, 4)),
}


def preset(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise ConfigError(
            f"unknown simulate.{kind} {name!r}; choose one of: {', '.join(sorted(table))}"
        ) from None


def window_pairs(begin: int, tokens: int, window: int) -> int:
    """Query x key pairs of a chunk computing rows [begin, begin + tokens) in
    a layer of window W: row p reads min(p + 1, W) keys."""
    lo, hi = begin + 1, begin + tokens          # keys row begin reads .. row end - 1 reads
    top = min(hi, window)
    ramp = (lo + top) * (top - lo + 1) // 2 if top >= lo else 0
    return ramp + window * max(0, hi - max(lo - 1, window))


class CostModel:
    def __init__(self, model: ModelPreset, gpu: GpuPreset):
        self.model, self.gpu = model, gpu
        self._flops = gpu.flops * gpu.mfu
        self._bw = gpu.mem_bw * gpu.mbu
        self._weight_bytes = model.weight_bytes_total
        self._dense = 2 * model.compute_params
        per_layer = 4 * model.q_heads * model.head_dim
        self._attn = per_layer * model.full_layers
        self._attn_w = per_layer * model.sliding_layers
        self._kvb = model.kv_bytes_per_token
        self._kvb_full = model.kv_layer_bytes * model.full_layers
        self._kvb_w = model.kv_layer_bytes * model.sliding_layers
        self.window = model.window

    def round_factor(self, has_prefill: bool, num_decodes: int, neighbours: int) -> float:
        """A measured profile's correction to a round (sim/cost/profile.py);
        the GPU presets' form needs none (each engine has its own GPU)."""
        return 1.0

    def round_seconds(self, prefills, decode_contexts: int, num_decodes: int,
                      window_contexts: int | None = None) -> float:
        """`prefills`: (begin, tokens) per chunk; `decode_contexts`: the sum
        of context lengths the decodes attend over; `window_contexts`: the
        sum of min(context, window) over them, what a sliding layer reads
        (None: min(decode_contexts, num_decodes x window), exact when every
        context is on the same side of the window)."""
        tokens = num_decodes
        pairs = decode_contexts
        kv = decode_contexts
        for begin, n in prefills:
            tokens += n
            pairs += n * (begin + (n + 1) / 2)
            kv += begin + n
        if tokens == 0:
            return 0.0
        compute = self._dense * tokens + self._attn * pairs
        memory = self._weight_bytes + self._kvb_full * kv
        if self._attn_w:
            w = self.window
            if window_contexts is None:
                window_contexts = min(decode_contexts, num_decodes * w)
            w_pairs = w_kv = window_contexts
            for begin, n in prefills:
                w_pairs += window_pairs(begin, n, w)
                w_kv += min(begin, w - 1) + n
            compute += self._attn_w * w_pairs
            memory += self._kvb_w * w_kv
        return max(compute / self._flops, memory / self._bw) + self.gpu.overhead_s

    def copy_seconds(self, tokens: int, bytes_per_token: int | None = None) -> float:
        """Host <-> device time for `tokens` tokens of KV: of every layer, or
        `bytes_per_token` each (one cache group's layers)."""
        if not tokens:
            return 0.0
        return tokens * (bytes_per_token or self._kvb) / self.gpu.pcie_bw
