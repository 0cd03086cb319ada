"""What a mixture-of-experts layer and a latent-attention layer are, read
from a Hugging Face config.json: `MoeSpec` (how many experts, how a token
picks its top k, the shared expert, which layers are sparse) and `MlaSpec`
(DeepSeek's multi-head latent attention: the low-rank query and KV
projections and the split of a head into its rotary and plain parts).

Pure dict-to-dataclass reading, stdlib only: `ModelConfig` carries these
as its `moe` and `mla` fields, and a config that asks for something the
families here do not run raises ValueError naming it and what is run
(model_config.py adds the directory to the message)."""

from __future__ import annotations

import math
from dataclasses import dataclass

SOFTMAX, SIGMOID = "softmax", "sigmoid"      # how router logits become scores


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int                   # experts each token runs
    intermediate: int            # one routed expert's MLP width
    sparse_layers: tuple         # the layers whose MLP is the experts (others: dense)
    norm_topk_prob: bool         # the k chosen weights renormalized to sum to 1
    scoring: str = SOFTMAX       # softmax over every expert (Qwen) or per-expert sigmoid (DeepSeek)
    # DeepSeek-V3's grouped choice: the experts fall into n_group groups; a
    # token keeps the topk_group groups whose two best (bias-corrected)
    # scores sum highest, and picks its k among their experts only
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False   # a per-expert bias added to the scores for choice only
    routed_scaling: float = 1.0     # the routed experts' sum times this (not the shared one's)
    shared_intermediate: int = 0    # a shared expert every token runs (0: none)
    router_fp32: bool = False       # router logits in float32 whatever the model dtype
    # the experts this rank holds under expert parallelism (moe/sharding.py):
    # [first_local, first_local + local_count); local_count 0: every one
    first_local: int = 0
    local_count: int = 0

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def local(self) -> range:
        """The routed experts this model (rank) holds."""
        return range(self.first_local, self.first_local + (self.local_count or self.num_experts))


@dataclass(frozen=True)
class MlaSpec:
    q_lora_rank: int             # 0: queries from one projection (q_proj), no low-rank pair
    kv_lora_rank: int            # the latent each token caches, per layer
    qk_nope_head_dim: int        # a query/key head's part without rotary positions
    qk_rope_head_dim: int        # its rotary part; the key's is one head shared by all
    v_head_dim: int
    rope_interleave: bool        # the checkpoint's rotary dims pair (0,1), (2,3), ...
    softmax_scale: float         # qk_head_dim ** -0.5, times YaRN's mscale squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Elements one token keeps per layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _check(raw: dict, key: str, allowed, what: str) -> None:
    value = raw.get(key, allowed[0])
    if value not in allowed:
        raise ValueError(f"{key} {value!r} is not supported; pdserve runs {what} with "
                         f"{' or '.join(repr(a) for a in allowed)}")


def _unquantized(raw: dict, family: str) -> None:
    """A checkpoint stored quantized (DeepSeek-V3's release is FP8 with
    128 x 128 block scales) would load its integers as weights: refuse it."""
    q = raw.get("quantization_config")
    if q:
        kind = q.get("quant_method", "?") if isinstance(q, dict) else q
        raise ValueError(f"quantization_config {kind!r}: pdserve loads {family} checkpoints "
                         "stored in float32, bfloat16 or float16; dequantize the weights "
                         "first (e.g. DeepSeek's fp8_cast_bf16.py) and drop "
                         "quantization_config")


def qwen3_moe_spec(raw: dict) -> MoeSpec:
    """Qwen3-MoE's experts (Qwen3MoeConfig; absent keys take its defaults):
    softmax over every expert, top k, renormalized iff norm_topk_prob. A
    layer is sparse unless mlp_only_layers names it, when it is one of every
    decoder_sparse_step layers."""
    _check(raw, "hidden_act", ("silu",), "Qwen3-MoE")
    _unquantized(raw, "Qwen3-MoE")
    if raw.get("attention_bias"):
        raise ValueError("attention_bias is set; pdserve runs Qwen3-MoE without projection "
                         "biases, as its released checkpoints are")
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window is set; pdserve runs Qwen3-MoE with full "
                         "attention in every layer (use_sliding_window: false)")
    n = raw.get("num_hidden_layers", 24)
    experts = raw.get("num_experts", raw.get("num_local_experts", 128))
    step = raw.get("decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(n)
                   if experts > 0 and i not in dense and (i + 1) % step == 0)
    return MoeSpec(experts, raw.get("num_experts_per_tok", 8),
                   raw.get("moe_intermediate_size", 768), sparse,
                   bool(raw.get("norm_topk_prob", False)))


def deepseek_v3_moe_spec(raw: dict) -> MoeSpec:
    """DeepSeek-V3's experts (DeepseekV3Config): sigmoid scores, a
    correction bias that steers the choice only, grouped top k, the routed
    sum scaled, one shared expert beside them; the first
    first_k_dense_replace layers dense."""
    _check(raw, "hidden_act", ("silu",), "DeepSeek-V3")
    _unquantized(raw, "DeepSeek-V3")
    _check(raw, "scoring_func", (SIGMOID,), "DeepSeek-V3's router")
    _check(raw, "topk_method", ("noaux_tc",), "DeepSeek-V3's router (DeepSeek-V2's greedy "
           "and group_limited_greedy choices are another family)")
    n = raw.get("num_hidden_layers", 61)
    experts = raw.get("n_routed_experts", 256)
    groups = raw.get("n_group", 8) or 1
    if experts % groups:
        raise ValueError(f"n_routed_experts {experts} is not a multiple of n_group {groups}")
    inter = raw.get("moe_intermediate_size", 2048)
    return MoeSpec(experts, raw.get("num_experts_per_tok", 8), inter,
                   tuple(range(raw.get("first_k_dense_replace", 3), n)),
                   bool(raw.get("norm_topk_prob", True)), SIGMOID, groups,
                   raw.get("topk_group", 4) or 1, True, float(raw.get("routed_scaling_factor", 2.5)),
                   inter * (raw.get("n_shared_experts") or 0), router_fp32=True)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_spec(raw: dict, rope: dict | None) -> MlaSpec:
    """DeepSeek-V3's latent attention. `rope`: the rope scaling in force
    (None: plain), whose mscale_all_dim also scales the softmax."""
    if raw.get("attention_bias"):
        raise ValueError("attention_bias is set; pdserve runs DeepSeek-V3's latent attention "
                         "without projection biases")
    nope, rot = raw.get("qk_nope_head_dim", 128), raw.get("qk_rope_head_dim", 64)
    scale = (nope + rot) ** -0.5
    if rope and rope.get("mscale_all_dim"):
        m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale *= m * m
    return MlaSpec(raw.get("q_lora_rank", 1536) or 0, raw.get("kv_lora_rank", 512), nope, rot,
                   raw.get("v_head_dim", 128), bool(raw.get("rope_interleave", True)), scale)
