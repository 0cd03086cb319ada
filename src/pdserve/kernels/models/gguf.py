"""GGUF checkpoints (llama.cpp's one-file format): the architecture facts,
the tokenizer's metadata and the weights, dequantized to float and renamed
to Hugging Face's names so `DecoderModel` (llama files) and
`Qwen3MoeModel` (qwen3moe files, whose experts come stacked one tensor a
projection and are split one tensor an expert) load them as they load
safetensors.

Two things differ from a Hugging Face checkpoint. llama.cpp's converter
permutes the rows of the Q and K projections (its rotary pairs adjacent
dimensions, Hugging Face's pairs the two halves of a head), so `weights`
undoes that permutation as transformers' GGUF loader does. And GGUF lists a
tensor's shape innermost first, the reverse of torch's.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch

from pdserve.kernels.models.model_config import ModelConfig, ModelError, weight_names
from pdserve.kernels.models.moe.qwen3_moe import qwen3_moe_weight_names
from pdserve.kernels.models.moe.specs import MoeSpec
from pdserve.kernels.cpu.quantized import KINDS, from_blocks

# general.architecture values pdserve runs, and the family each is
FAMILIES = {"llama": "llama", "qwen3moe": "qwen3_moe"}
ARCHS = tuple(FAMILIES)

# GGUF tensor name -> Hugging Face name; blk.N.* maps to model.layers.N.*
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# a MoE layer's experts, stacked [experts, out, in] in one tensor a projection
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                "ffn_down_exps": "down_proj"}
_EXPERTS = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")


def is_gguf_path(path) -> bool:
    return str(path).lower().endswith(".gguf")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name`, or None if pdserve has none."""
    top, _, kind = name.rpartition(".")
    if top in TOP_NAMES and kind in ("weight", "bias"):
        return f"{TOP_NAMES[top]}.{kind}"
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py's
    `permute`), as transformers' LlamaTensorProcessor does: the file holds a
    head's rows interleaved (Hugging Face rows 0, h, 1, h+1, ... for half
    h); this puts them back as 0..h-1, h..2h-1. Works on a weight or a bias."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field_value(field):
    """A metadata value as Python: str, int, float, bool, or a list of them."""
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        parts = [field.parts[i] for i in field.data]
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(p).decode("utf-8") for p in parts]
        return np.concatenate(parts).tolist() if parts else []
    part = field.parts[field.data[0]]
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    if kind == GGUFValueType.BOOL:
        return bool(part[0])
    return part[0].item()


class GGUFCheckpoint:
    """One opened .gguf file: metadata parsed, `config` derived (a ModelError
    if pdserve cannot run it), tensors left in the file until `weights`."""

    def __init__(self, path):
        p = Path(path)
        if not p.is_file():
            what = "is a directory, not a file" if p.is_dir() else "does not exist"
            raise ModelError(f"GGUF file {str(p)!r} {what}; set model.path to a .gguf file, "
                             "a Hugging Face checkpoint directory, or use a preset")
        from gguf import GGUFReader

        try:
            reader = GGUFReader(str(p))
        except (ValueError, OSError, IndexError) as e:
            raise ModelError(f"{p} is not a readable GGUF file ({e}); check the download "
                             "or point model.path at another checkpoint") from None
        self.path = str(p)
        self.metadata = {k: _field_value(f) for k, f in reader.fields.items()
                         if not k.startswith("GGUF.")}
        self._tensors = {t.name: t for t in reader.tensors}
        self.config = self._read_config()

    def _read_config(self) -> ModelConfig:
        meta = self.metadata
        arch = meta.get("general.architecture")
        if arch not in ARCHS:
            raise ModelError(f"{self.path}: GGUF architecture {arch!r} is not supported; pdserve "
                             f"reads {', '.join(ARCHS)} GGUF files (for other models use a Hugging "
                             "Face checkpoint directory)")

        def need(key):
            if f"{arch}.{key}" not in meta:
                raise ModelError(f"{self.path}: GGUF metadata lacks {arch}.{key}; the file is "
                                 "incomplete or from an unsupported converter")
            return meta[f"{arch}.{key}"]

        hidden, heads = need("embedding_length"), need("attention.head_count")
        head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
        self._refuse_unsupported(arch, head_dim)
        tokens = meta.get("tokenizer.ggml.tokens")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        moe = self._experts(arch, need) if arch == "qwen3moe" else None
        return ModelConfig(
            arch=FAMILIES[arch],
            moe=moe,
            vocab_size=len(tokens) if tokens else need("vocab_size"),
            hidden_size=hidden,
            num_layers=need("block_count"),
            num_heads=heads,
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv") or heads,
            head_dim=head_dim,
            intermediate_size=meta.get(f"{arch}.feed_forward_length") or
            need("expert_feed_forward_length" if moe else "feed_forward_length"),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(arch),
            max_position=meta.get(f"{arch}.context_length", 4096),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(eos,) if eos is not None else (),
            # the weights are dequantized to float32, as transformers does
            torch_dtype="float32",
            quantization=self._quantization(),
        )

    def _experts(self, arch: str, need) -> MoeSpec:
        """A Qwen3-MoE file's experts: every layer sparse, softmax routing
        renormalized over the chosen k (llama.cpp's qwen3moe graph does)."""
        return MoeSpec(need("expert_count"), need("expert_used_count"),
                       need("expert_feed_forward_length"), tuple(range(need("block_count"))),
                       norm_topk_prob=True)

    def _quantization(self) -> str | None:
        """The file's quantized tensor types, most tensors first; None when
        every tensor is stored as a float."""
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            kind = t.tensor_type.name
            if kind not in ("F32", "F16", "BF16", "F64"):
                counts[kind] = counts.get(kind, 0) + 1
        return ", ".join(sorted(counts, key=lambda k: -counts[k])) or None

    def _refuse_unsupported(self, arch: str, head_dim: int) -> None:
        """A ModelError for what DecoderModel would run wrong, not just differently."""
        rotary = self.metadata.get(f"{arch}.rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise ModelError(f"{self.path}: rotary over {rotary} of {head_dim} head dimensions "
                             "(partial rotary) is not supported")
        if "rope_freqs.weight" in self._tensors:
            raise ModelError(f"{self.path}: the file carries rope_freqs (Llama 3.1-style rope "
                             "scaling), which pdserve does not read; use the Hugging Face "
                             "checkpoint")
        unknown = [n for n in self._tensors if hf_name(n) is None and not _EXPERTS.fullmatch(n)]
        if unknown:
            raise ModelError(f"{self.path}: {len(unknown)} GGUF tensors have no place in a "
                             f"Llama decoder, e.g. {unknown[0]!r}; this model is not supported")

    def _rope_scaling(self, arch: str) -> dict | None:
        meta = self.metadata
        kind = meta.get(f"{arch}.rope.scaling.type")
        factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
        if kind == "none" or (kind is None and factor in (None, 1.0)):
            return None
        if kind in (None, "linear"):
            return {"rope_type": "linear", "factor": float(factor)}
        raise ModelError(f"{self.path}: rope scaling {kind!r} is not supported; pdserve reads "
                         "GGUF files with no rope scaling or linear scaling")

    def weights(self, dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> dict:
        """Every tensor under its Hugging Face name: dequantized to float32,
        then cast to `dtype`, with Q and K rows back in Hugging Face's order.
        `keep_quantized`: tensors stored as Q4_0, Q4_1 or Q8_0 come as
        QuantizedTensor (kernels/cpu/quantized.py), the file's integers."""
        from gguf.quants import dequantize

        cfg = self.config
        out: dict = {}
        for name, t in self._tensors.items():
            shape = tuple(int(d) for d in reversed(t.shape))
            if keep_quantized and t.tensor_type.name in KINDS and len(shape) == 2:
                qt = from_blocks(np.asarray(t.data), t.tensor_type.name, *shape)
                heads = cfg.num_heads if ".attn_q." in name else \
                    cfg.num_kv_heads if ".attn_k." in name else 0
                if heads:
                    qt = qt.rows(unpermute_rotary(torch.arange(shape[0]), heads))
                out[hf_name(name)] = qt
                continue
            try:
                # a plain array, not the memmap subclass: its per-slice hooks cost seconds
                a = dequantize(np.asarray(t.data), t.tensor_type)
            except NotImplementedError:
                raise ModelError(f"{self.path}: tensor {name} is stored as {t.tensor_type.name}, "
                                 "which the gguf package cannot dequantize; use another "
                                 "quantization of the model") from None
            if not a.flags.writeable:           # a view of the read-only file mapping
                a = a.copy()
            # GGUF lists dimensions innermost first
            w = torch.from_numpy(a).reshape(shape)
            experts = _EXPERTS.fullmatch(name)
            if experts:                         # one tensor an expert, as checkpoints name them
                p = f"model.layers.{experts.group(1)}.mlp.experts."
                for e in range(shape[0]):
                    out[f"{p}{e}.{EXPERT_NAMES[experts.group(2)]}.weight"] = w[e].to(dtype)
                continue
            # llama.cpp permutes a llama file's Q and K rows only (qwen rotates NeoX-style)
            if ".attn_q." in name and cfg.arch == "llama":
                w = unpermute_rotary(w, cfg.num_heads)
            elif ".attn_k." in name and cfg.arch == "llama":
                w = unpermute_rotary(w, cfg.num_kv_heads)
            out[hf_name(name)] = w.to(dtype)
        names = qwen3_moe_weight_names(cfg) if cfg.moe is not None else weight_names(cfg)
        missing = [n for n in names if n not in out]
        if missing:
            raise ModelError(f"{self.path}: the file lacks {len(missing)} weights, e.g. "
                             f"{missing[0]} (Hugging Face's name)")
        rows = out["model.embed_tokens.weight"].shape[0]
        if rows != cfg.vocab_size:
            raise ModelError(f"{self.path}: token_embd has {rows} rows for a vocabulary of "
                             f"{cfg.vocab_size} tokens; the file is inconsistent")
        return out


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_gguf(path) -> GGUFCheckpoint:
    """The checkpoint at `path`. Parsing a GGUF's metadata takes seconds (one
    field per vocabulary entry), and a deployment reads the config and the
    tokenizer separately, so an unchanged file is parsed once."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return GGUFCheckpoint(p)            # raises the ModelError that says why
    return _open(str(p.resolve()), st.st_mtime_ns, st.st_size)
