"""Load a model: a Hugging Face checkpoint directory or the tiny preset."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.kernels.attention import make_backend
from pdserve.kernels.model import DecoderModel, random_weights, weight_names
from pdserve.kernels.model_config import ModelConfig, ModelError, read_config, tiny_config
from pdserve.kernels.tokenizer import HFTokenizer, PrintableTokenizer

TINY_SEED = 20261129
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_safetensors(d: Path, cfg: ModelConfig) -> dict:
    from safetensors.torch import load_file

    index = d / "model.safetensors.index.json"
    if index.is_file():                # sharded: read the shards the index names, only
        import json

        files = sorted({d / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{d} has no *.safetensors weights; pdserve reads safetensors "
                         "checkpoints (save with save_pretrained(safe_serialization=True))")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    need = weight_names(cfg)
    missing = [n for n in need if n not in weights]
    if cfg.tie_word_embeddings is False and "lm_head.weight" in missing \
            and "model.embed_tokens.weight" in weights:
        missing.remove("lm_head.weight")
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    if missing:
        raise ModelError(f"{d}: checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
    return weights


def resolve_dtype(dtype: str, cfg: ModelConfig, device) -> torch.dtype:
    """'auto' is the checkpoint's dtype (float32 for the tiny preset), except
    float16 on CPU, which runs as bfloat16: CPUs with bfloat16 instructions
    multiply in it several times faster than in float16 (or float32)."""
    if dtype != "auto":
        return DTYPES[dtype]
    own = cfg.torch_dtype if cfg.torch_dtype in ("float32", "bfloat16", "float16") else "float32"
    if own == "float16" and torch.device(device).type == "cpu":
        own = "bfloat16"
    return DTYPES[own]


def check_device(device) -> torch.device:
    """The torch device, or a ModelError saying why it cannot be used."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "has no CUDA support" if torch.version.cuda is None else "sees no GPU"
            raise ModelError(f"device {device!r}: no CUDA GPU is usable here (this torch "
                             f"{why}); use device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) here")
    elif dev.type != "cpu":
        raise ModelError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return dev


def load_model(path: str | None = None, preset: str | None = "tiny", *, dtype="auto",
               device="cpu", attention="auto"):
    """(model, tokenizer) for a checkpoint directory or a preset."""
    check_device(device)
    if dtype not in DTYPES and dtype != "auto":
        raise ModelError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
    if path is not None:
        d = Path(path)
        cfg = read_config(d)
        weights = _read_safetensors(d, cfg)
        tok = HFTokenizer(d)
    elif preset == "tiny":
        cfg = tiny_config()
        weights = random_weights(cfg, TINY_SEED)
        tok = PrintableTokenizer()
    else:
        raise ModelError(f"unknown model preset {preset!r}; use preset: tiny or path: DIR")
    torch_dtype = resolve_dtype(dtype, cfg, device)
    backend = make_backend(attention, device, torch_dtype, num_heads=cfg.num_heads,
                           num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           sliding_window=cfg.sliding_window)
    return DecoderModel(cfg, weights, torch_dtype, device, backend), tok


def load_tokenizer(path: str | None = None, preset: str | None = "tiny"):
    """The tokenizer alone (the router's): no weights are read."""
    if path is not None:
        read_config(path)          # the same errors as load_model for a bad directory
        return HFTokenizer(path)
    if preset == "tiny":
        return PrintableTokenizer()
    raise ModelError(f"unknown model preset {preset!r}; use preset: tiny or path: DIR")
