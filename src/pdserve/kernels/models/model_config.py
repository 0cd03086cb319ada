"""The architecture facts a decoder needs, read from a Hugging Face
config.json or a GGUF file's metadata, or the embedded tiny preset; and
the cache groups they imply (which layers share a block table). Layers that
keep a fixed-size state instead of K/V (Qwen3.5's Gated DeltaNet, LFM2's
short conv) are in no K/V group: `state_layers` names them, `state_group`
makes their snapshot-state group, and `state_slot_bytes` sizes one
sequence's state."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.kernels.models.moe.specs import (
    MlaSpec, MoeSpec, deepseek_v3_moe_spec, mla_spec, qwen3_moe_spec)
from pdserve.scheduler.cache.groups import (
    FULL_HISTORY, SLIDING_WINDOW, SNAPSHOT_STATE, CacheGroupSpec)

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Lfm2ForCausalLM": "lfm2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# config.json's model_type, for checkpoints that do not list architectures
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3_text": "gemma3",
               "qwen3_5_text": "qwen3_5", "lfm2": "lfm2", "qwen3_moe": "qwen3_moe",
               "deepseek_v3": "deepseek_v3"}
# multimodal checkpoints whose text model pdserve runs only when saved alone
MULTIMODAL = {
    "Gemma3ForConditionalGeneration": "Gemma 3's multimodal checkpoint; pdserve runs the "
                                      "text-only Gemma3ForCausalLM (e.g. google/gemma-3-1b-it)",
    "Qwen3_5ForConditionalGeneration": "Qwen3.5's multimodal checkpoint (vision encoder and "
                                       "text model); pdserve runs the text-only "
                                       "Qwen3_5ForCausalLM: save the text model alone with "
                                       "transformers (Qwen3_5ForCausalLM.from_pretrained(DIR)"
                                       ".save_pretrained(OUT)), copy its tokenizer files "
                                       "there, and point model.path at OUT",
}
MULTIMODAL_TYPES = {"gemma3": "Gemma3ForConditionalGeneration",
                    "qwen3_5": "Qwen3_5ForConditionalGeneration"}
SLIDING, GLOBAL = "sliding_attention", "full_attention"     # Hugging Face's layer_types
LINEAR = "linear_attention"        # a Gated DeltaNet layer: a recurrent state, no K/V
CONV = "conv"                      # an LFM2 short-conv layer: a conv state alone, no K/V


class ModelError(ValueError):
    """A model directory or preset pdserve cannot load; says what to change."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple = field(default_factory=tuple)
    torch_dtype: str | None = None     # the checkpoint's own dtype, for dtype: auto
    # A GGUF's quantized storage (its tensor types, e.g. "Q4_1, Q8_0"), which
    # the loader dequantizes; None for float weights.
    quantization: str | None = None
    # Per layer, SLIDING or GLOBAL. Empty: every layer slides when
    # sliding_window is set (Mistral), else none does.
    layer_types: tuple = ()
    hidden_act: str = "silu"           # the MLP's gate activation
    # Gemma 3: the attention scale is query_pre_attn_scalar ** -0.5 (None:
    # head_dim's); optional tanh caps on attention scores and final logits;
    # sliding layers rotate with their own base and scaling.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    rope_local_scaling: dict | None = None
    # Qwen3.5: rotary positions turn only the first head_dim * this dims of q
    # and k. Its LINEAR layers (Gated DeltaNet) mix tokens through a causal
    # depthwise conv of linear_conv_kernel taps over q, k and v, then a gated
    # delta rule whose state is, per value head, a key_dim x value_dim matrix.
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # LFM2: its CONV layers gate a depthwise conv of linear_conv_kernel taps
    # over the hidden size (B * x in, C * conv out), with biases if conv_bias
    conv_bias: bool = False
    # Mixture of experts (Qwen3-MoE, DeepSeek-V3): the sparse layers' experts
    # and their routing; DeepSeek's latent attention (moe/specs.py)
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None

    @property
    def kv_parts(self) -> int:
        """What a token keeps per layer and KV head: K and V (2), or
        latent attention's one entry (1)."""
        return 1 if self.mla is not None else 2

    def layer_window(self, i: int) -> int | None:
        """Tokens layer i's queries see, themselves included (None: all)."""
        if self.sliding_window is None:
            return None
        if not self.layer_types or self.layer_types[i] == SLIDING:
            return self.sliding_window
        return None

    def state_layers(self) -> tuple:
        """The layers that keep a recurrent state instead of K/V (Qwen3.5's
        Gated DeltaNet), in order: StateCache layer j is layer
        state_layers()[j]. They are in no cache group."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in (LINEAR, CONV))

    @property
    def conv_dim(self) -> int:
        """Channels of a state layer's conv: a Gated DeltaNet's q, k and v;
        an LFM2 conv's hidden size."""
        if self.arch == "lfm2":
            return self.hidden_size
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim \
            + self.linear_num_value_heads * self.linear_value_head_dim

    def conv_state_shape(self) -> tuple:
        """One state layer's conv state: the last kernel - 1 inputs of each channel."""
        return (self.conv_dim, self.linear_conv_kernel - 1)

    def recurrent_state_shape(self) -> tuple:
        """One state layer's delta-rule state: a key x value matrix per value
        head (LFM2's conv layers keep none: zero elements)."""
        return (self.linear_num_value_heads, self.linear_key_head_dim,
                self.linear_value_head_dim)

    def state_slot_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one state slot (one sequence's state at one point, every
        state layer): the conv state in the model dtype (`dtype_bytes` per
        element), the recurrent state in float32 whatever the model dtype."""
        if not self.state_layers():
            return 0
        channels, width = self.conv_state_shape()
        h, dk, dv = self.recurrent_state_shape()
        return len(self.state_layers()) * (channels * width * dtype_bytes + h * dk * dv * 4)

    @property
    def full_history(self) -> bool:
        """Some layer keeps every position's K/V (not every layer slides): a
        prompt's working set then grows with it."""
        return any(g.keeps_history for g in self.cache_groups())

    def state_group(self, block: int = 0) -> CacheGroupSpec | None:
        """The snapshot-state group of the layers keeping a recurrent state
        (spec §1.2), checkpointed every `block` tokens (0: every page); None
        for a model without such layers. It comes after `cache_groups()`."""
        layers = self.state_layers()
        return CacheGroupSpec(SNAPSHOT_STATE, block=block, layers=layers) if layers else None

    def cache_groups(self, replayable: bool = False) -> list[CacheGroupSpec]:
        """The attention layers grouped by what they keep: the full-history
        group first (if any layer reads all history), then one group per
        window, smallest first. `replayable` marks every sliding group as
        recomputed from re-fed tokens instead of prefix-cached (spec §1.3).
        State layers (`state_layers`) keep no K/V and are in no group."""
        by_window: dict = {}
        state = set(self.state_layers())
        for i in range(self.num_layers):
            if i in state:
                continue
            by_window.setdefault(self.layer_window(i), []).append(i)
        groups = []
        if None in by_window:
            groups.append(CacheGroupSpec(FULL_HISTORY, layers=tuple(by_window.pop(None))))
        # a re-fed row is exact in a sliding layer only if the rows its window
        # reads were exact below it: each stacked sliding layer reaches W - 1
        # further back, so exact regeneration re-feeds the sum over them
        replay = sum((w - 1) * len(layers) for w, layers in by_window.items()) \
            if replayable else 0
        for w in sorted(by_window):
            groups.append(CacheGroupSpec(SLIDING_WINDOW, window=w, replayable=replayable,
                                         layers=tuple(by_window[w]), replay=replay))
        return groups


def tiny_config() -> ModelConfig:
    """The embedded default: a small Llama over printable characters."""
    return ModelConfig(arch="llama", vocab_size=98, hidden_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=160,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position=4096,
                       tie_word_embeddings=False, bos_token_id=96, eos_token_ids=(97,))


def read_config(path) -> ModelConfig:
    """The config of a checkpoint directory (a .gguf file's is
    loader.model_config_for's: its metadata, no tensor read)."""
    d = Path(path)
    if str(d).lower().endswith(".gguf"):
        raise ModelError(f"{str(d)!r} is a GGUF file: its config is loader.model_config_for's "
                         "(read_config reads checkpoint directories)")
    if not d.is_dir():
        what = "is a file, not a directory" if d.exists() else "does not exist"
        raise ModelError(f"model directory {str(d)!r} {what}; set model.path to a Hugging "
                         "Face checkpoint directory or a .gguf file, or use model: {preset: tiny}")
    config_file = d / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{d} has no config.json; point model.path at a Hugging Face "
                         "checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    raw = json.loads(config_file.read_text())
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None) if archs \
        else MODEL_TYPES.get(raw.get("model_type"))
    multimodal = next((a for a in archs if a in MULTIMODAL), None) if archs \
        else MULTIMODAL_TYPES.get(raw.get("model_type"))
    if arch is None and multimodal:
        raise ModelError(f"{d}: {multimodal} is {MULTIMODAL[multimodal]}")
    if arch is None:
        raise ModelError(f"{d}: architecture {archs or raw.get('model_type')!r} is not "
                         f"supported; pdserve runs {', '.join(sorted(SUPPORTED))}")
    family = {"gemma3": _gemma3_config, "qwen3_5": _qwen3_5_config, "lfm2": _lfm2_config,
              "qwen3_moe": _qwen3_moe_config, "deepseek_v3": _deepseek_v3_config}.get(arch)
    return family(d, raw) if family is not None else _llama_config(raw, arch)


def _llama_config(raw: dict, arch: str) -> ModelConfig:
    """The Llama family's reading of config.json (llama, mistral, qwen2),
    which the MoE families start from."""
    heads = raw["num_attention_heads"]
    eos_ids = _eos_ids(raw)
    # transformers 5 writes rope_parameters; older checkpoints rope_scaling + rope_theta
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                          else None)
    window = raw.get("sliding_window")
    layer_types = ()
    if arch in ("qwen2", "qwen3_moe"):
        window, layer_types = _qwen2_windows(raw)
    return ModelConfig(
        arch=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=raw.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        max_position=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or raw.get("attention_bias", False),
        sliding_window=window,
        layer_types=layer_types,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        # transformers 5 writes dtype; earlier versions torch_dtype
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _qwen3_moe_config(d: Path, raw: dict) -> ModelConfig:
    """Qwen3-MoE: the Llama family's reading plus its experts (`moe`)."""
    try:
        return dataclasses.replace(_llama_config(raw, "qwen3_moe"), moe=qwen3_moe_spec(raw))
    except ValueError as e:
        raise ModelError(f"{d}: {e}") from None


def _deepseek_v3_config(d: Path, raw: dict) -> ModelConfig:
    """DeepSeek-V3: its experts (`moe`) and latent attention (`mla`), whose
    cache is what it is: one entry a token and layer (the latent and the
    rotary key), so `num_kv_heads` 1 of `head_dim` that width and one part
    (`kv_parts`) where attention keeps K and V."""
    try:
        base = _llama_config(raw, "deepseek_v3")
        mla = mla_spec(raw, base.rope_scaling)
        return dataclasses.replace(base, num_kv_heads=1, head_dim=mla.cache_width, mla=mla,
                                   moe=deepseek_v3_moe_spec(raw))
    except ValueError as e:
        raise ModelError(f"{d}: {e}") from None


def _eos_ids(raw: dict) -> tuple:
    eos = raw.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def _qwen2_windows(raw: dict) -> tuple[int | None, tuple]:
    """Qwen2 slides only with use_sliding_window, and then only in the layers
    its layer_types names (written by transformers 5), or else in layers
    max_window_layers and up, as transformers reads older configs."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window", False) or window is None:
        return None, ()
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types") or [SLIDING if i >= raw.get("max_window_layers", 28)
                                       else GLOBAL for i in range(n)]
    return window, tuple(types)


def _gemma3_config(d: Path, raw: dict) -> ModelConfig:
    """Gemma 3 text. Absent keys take Gemma3TextConfig's defaults, which
    differ from Llama's (tied embeddings, head_dim 256, window 4096). Local
    and global layers: `layer_types`, or in older configs every
    `sliding_window_pattern`-th layer global. RoPE: transformers 5 writes
    rope_parameters per layer type; older configs rope_theta and
    rope_scaling (global layers) and rope_local_base_freq (local ones)."""
    if raw.get("use_bidirectional_attention"):
        raise ModelError(f"{d}: use_bidirectional_attention is set (an embedding model); "
                         "pdserve serves causal Gemma 3 only")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new"):     # both the tanh approximation
        raise ModelError(f"{d}: hidden_activation {act!r} is not supported; pdserve runs "
                         "Gemma 3 with gelu_pytorch_tanh")
    n = raw.get("num_hidden_layers", 26)
    types = raw.get("layer_types")
    if not types:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        types = [SLIDING if (i + 1) % pattern else GLOBAL for i in range(n)]
    if len(types) != n or set(types) - {SLIDING, GLOBAL}:
        raise ModelError(f"{d}: layer_types must name {SLIDING!r} or {GLOBAL!r} for each of "
                         f"the {n} layers, got {types!r}")
    params = raw.get("rope_parameters") or {}
    glob, local = params.get(GLOBAL) or {}, params.get(SLIDING) or {}

    def scaling(p: dict, legacy):
        if p:
            return p if p.get("rope_type", "default") != "default" else None
        return legacy

    heads = raw.get("num_attention_heads", 8)
    window = raw.get("sliding_window", 4096)
    return ModelConfig(
        arch="gemma3",
        vocab_size=raw.get("vocab_size", 262_208),
        hidden_size=raw.get("hidden_size", 2304),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or 256,
        intermediate_size=raw.get("intermediate_size", 9216),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=glob.get("rope_theta", raw.get("rope_theta", 1_000_000.0)),
        rope_scaling=scaling(glob, raw.get("rope_scaling")),
        max_position=raw.get("max_position_embeddings", 131_072),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        attention_bias=raw.get("attention_bias", False),
        sliding_window=window if SLIDING in types else None,
        layer_types=tuple(types) if window is not None else (),
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
        rope_local_theta=local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)),
        rope_local_scaling=scaling(local, None),
        bos_token_id=raw.get("bos_token_id", 2),
        eos_token_ids=_eos_ids({"eos_token_id": raw.get("eos_token_id", 1)}),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _qwen3_5_config(d: Path, raw: dict) -> ModelConfig:
    """Qwen3.5 text (Qwen3_5TextConfig): Gated DeltaNet layers beside full
    attention ones, per `layer_types` (absent: every `full_attention_interval`-th
    layer attends). Absent keys take Qwen3_5TextConfig's defaults. RoPE:
    rope_parameters (transformers 5), or top-level rope_theta and
    partial_rotary_factor; its multimodal rotary sections (mrope_section)
    turn text positions exactly as plain RoPE, every section at the same
    position."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelError(f"{d}: hidden_act {act!r} is not supported; pdserve runs Qwen3.5 "
                         "with silu")
    n = raw.get("num_hidden_layers", 32)
    types = raw.get("layer_types")
    if not types:
        every = raw.get("full_attention_interval", 4)
        types = [GLOBAL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, GLOBAL}:
        raise ModelError(f"{d}: layer_types must name {LINEAR!r} or {GLOBAL!r} for each of "
                         f"the {n} layers, got {types!r}")
    rope = raw.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    heads = raw.get("num_attention_heads", 16)
    return ModelConfig(
        arch="qwen3_5",
        vocab_size=raw.get("vocab_size", 248_320),
        hidden_size=raw.get("hidden_size", 4096),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or 4,
        head_dim=raw.get("head_dim") or 256,
        intermediate_size=raw.get("intermediate_size", 12_288),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10_000.0)),
        rope_scaling=rope if kind != "default" else None,
        max_position=raw.get("max_position_embeddings", 32_768),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", False),
        layer_types=tuple(types),
        partial_rotary_factor=rope.get("partial_rotary_factor",
                                       raw.get("partial_rotary_factor", 0.25)),
        linear_num_key_heads=raw.get("linear_num_key_heads", 16),
        linear_num_value_heads=raw.get("linear_num_value_heads", 32),
        linear_key_head_dim=raw.get("linear_key_head_dim", 128),
        linear_value_head_dim=raw.get("linear_value_head_dim", 128),
        linear_conv_kernel=raw.get("linear_conv_kernel_dim", 4),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def _lfm2_config(d: Path, raw: dict) -> ModelConfig:
    """LFM2 (Lfm2Config): short-conv layers beside full attention ones, per
    `layer_types` (absent: the layers in `full_attn_idxs` attend). The MLP's
    width is adjusted as Lfm2MLP does when block_auto_adjust_ff_dim is set;
    absent keys take Lfm2Config's defaults."""
    n = raw.get("num_hidden_layers", 32)
    types = raw.get("layer_types")
    if not types:
        full = raw.get("full_attn_idxs")
        full = set(range(n) if full is None else full)
        types = [GLOBAL if i in full else CONV for i in range(n)]
    if len(types) != n or set(types) - {CONV, GLOBAL}:
        raise ModelError(f"{d}: layer_types must name {CONV!r} or {GLOBAL!r} for each of the "
                         f"{n} layers, got {types!r}")
    inter = raw.get("block_ff_dim", raw.get("intermediate_size", 12_288))
    if raw.get("block_auto_adjust_ff_dim", True):
        inter = int(2 * inter / 3)
        mult = raw.get("block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            of = raw.get("block_multiple_of", 256)
            inter = of * ((int(mult * inter) + of - 1) // of)
    rope = raw.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    heads = raw.get("num_attention_heads", 32)
    hidden = raw.get("hidden_size", 2560)
    return ModelConfig(
        arch="lfm2",
        vocab_size=raw.get("vocab_size", 65_536),
        hidden_size=hidden,
        num_layers=n,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or 8,
        head_dim=hidden // heads,
        intermediate_size=inter,
        rms_norm_eps=raw.get("norm_eps", 1e-5),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0)),
        rope_scaling=rope if kind != "default" else None,
        max_position=raw.get("max_position_embeddings", 128_000),
        tie_word_embeddings=raw.get("tie_embedding", raw.get("tie_word_embeddings", True)),
        layer_types=tuple(types),
        linear_conv_kernel=raw.get("conv_L_cache", 3),
        conv_bias=raw.get("conv_bias", False),
        bos_token_id=raw.get("bos_token_id", 1),
        eos_token_ids=_eos_ids(raw),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
    )


def weight_names(cfg: ModelConfig) -> list[str]:
    """The tensors a Llama-family checkpoint of `cfg` holds, by Hugging Face's names."""
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
