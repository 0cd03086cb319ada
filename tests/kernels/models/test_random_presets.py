"""Presets of a real model's shape with seeded random weights
(kernels/models/shapes.py): what a GPU run serves and calibrates on
without a checkpoint, as vLLM's --load-format dummy."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import ServeConfig
from pdserve.kernels.models.loader import (PRESETS, load_model, load_tokenizer,
                                           model_config_for, resolve_model_path)
from pdserve.kernels.models.model_config import ModelError
from pdserve.kernels.models.shapes import RANDOM_PRESETS, SHAPES
from pdserve.text.tokenizer import PrintableTokenizer


def test_every_shape_but_the_tiny_ones_is_a_preset_with_no_file():
    assert set(RANDOM_PRESETS) == {f"{s}-random" for s in SHAPES if not s.startswith("tiny")}
    assert "qwen3-30b-a3b-12l-random" in RANDOM_PRESETS
    assert set(RANDOM_PRESETS) <= set(PRESETS)
    for preset in RANDOM_PRESETS:
        assert resolve_model_path(None, preset) is None
        assert isinstance(load_tokenizer(None, preset), PrintableTokenizer)


def test_a_random_preset_has_its_shapes_config_without_loading():
    cfg = model_config_for(None, "llama-3-8b-random")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads) == \
        (128256, 4096, 32, 8)
    assert cfg.torch_dtype == "bfloat16" and cfg.eos_token_ids == (97,)


def test_a_random_preset_loads_the_same_weights_every_time():
    a, tok = load_model(preset="llama-110m-random", dtype="float32")
    b, _ = load_model(preset="llama-110m-random", dtype="float32")
    assert a.cfg == model_config_for(None, "llama-110m-random")
    assert isinstance(tok, PrintableTokenizer)
    ids = torch.tensor([5, 17, 33, 40])
    assert torch.equal(a.embed[ids], b.embed[ids]) and a.embed[ids].abs().sum() > 0


def test_a_moe_shape_draws_its_router_experts_and_qk_norms():
    """Qwen3-MoE's tensors at their shapes (the q/k norms a head wide), the
    model its own class, seeded."""
    from pdserve.kernels.models.loader import (attention_shape, build_model,
                                               checkpoint_weight_names, load_backend)
    from pdserve.kernels.models.model import random_weights
    from pdserve.kernels.models.shapes import model_config

    cfg = model_config("tiny-moe")
    names = checkpoint_weight_names(cfg)
    w = random_weights(cfg, 0, names=names)
    assert set(w) == set(names)
    p = "model.layers.1."
    assert w[p + "mlp.gate.weight"].shape == (8, 64)
    assert w[p + "mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert w[p + "self_attn.k_norm.weight"].shape == (16,)
    assert torch.equal(w[p + "mlp.experts.3.up_proj.weight"],
                       random_weights(cfg, 0, names=names)[p + "mlp.experts.3.up_proj.weight"])
    backend = load_backend("torch", "cpu", torch.float32, attention_shape(cfg))
    model = build_model(cfg, w, torch.float32, "cpu", backend)
    assert type(model).__name__ == "Qwen3MoeModel" and len(model.expert_layers()) == 2
    cfg8 = model_config_for(None, "qwen3-30b-a3b-12l-random")
    assert cfg8.arch == "qwen3_moe" and (cfg8.moe.num_experts, cfg8.moe.top_k) == (128, 8)


def test_model_dtype_auto_runs_a_random_preset_in_bfloat16():
    model, _ = load_model(preset="llama-110m-random")
    assert model.dtype == torch.bfloat16


def test_an_engine_serves_a_random_preset():
    cfg = ServeConfig.from_dict({"model": {"preset": "llama-110m-random", "dtype": "float32"},
                                 "engine": {"page_size": 16, "total_pages": 64}})
    with LLM(cfg) as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0,
                                                          ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    assert all(0 <= t < SHAPES["llama-110m"]["vocab_size"] for t in out[0].token_ids)


def test_a_misspelt_random_preset_lists_the_presets():
    with pytest.raises(ModelError, match="use preset: tiny or smollm2-135m or "
                                         "llama-3-8b-random"):
        resolve_model_path(None, "llama-3-8b-rand")
