"""Qwen3-MoE (Qwen3MoeForCausalLM): our model against transformers on a
small random checkpoint (8 experts, top 2, renormalized; layer 1 dense
through mlp_only_layers): greedy tokens and logits straight through the
forward, then through the engine cold and with prefix hits (its stats counting
the tokens each expert ran); the same
weights as a qwen3moe GGUF; and the variants refused at load by name."""

import json

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.stats import expert_tokens
from pdserve.kernels.models.loader import load_model
from pdserve.kernels.models.model_config import ModelError, read_config
from support.checkpoints import hf_greedy
from support.moe import qwen3_moe_checkpoint, write_qwen3_moe_gguf
from support.tp import greedy

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 3) % 120 + 1 for i in range(23)], [5, 9, 11, 60]]
STEPS = 8
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return qwen3_moe_checkpoint(tmp_path_factory.mktemp("qwen3_moe"))


def test_the_config_names_the_sparse_layers_and_their_experts(checkpoint):
    _, d = checkpoint
    cfg = read_config(d)
    assert cfg.arch == "qwen3_moe" and cfg.kv_parts == 2
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate, moe.norm_topk_prob) == (8, 2, 32, True)
    assert moe.sparse_layers == (0, 2)            # mlp_only_layers [1]
    assert [g.layers for g in cfg.cache_groups()] == [(0, 1, 2)]


def test_greedy_tokens_and_logits_match_transformers(checkpoint):
    """Two prompts prefilled in one round, then decoded together: every
    token transformers' greedy generate gives, and the last logits within
    1e-4; every routed (token, expert) pair counted per layer."""
    hf, d = checkpoint
    model, _ = load_model(str(d), preset=None, dtype="float32", attention="torch")
    logits, tokens = greedy(model, PROMPTS, STEPS)
    for prompt, got in zip(PROMPTS, tokens):
        assert got == hf_greedy(hf, prompt, STEPS)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[0] + tokens[0]])).logits[0, -1]
    assert (logits[-1][0] - want).abs().max() < TOL
    rows = sum(len(p) for p in PROMPTS) + len(PROMPTS) * STEPS
    counts = [layer.counts for layer in model.expert_layers()]
    assert len(counts) == 2 and all(int(c.sum()) == 2 * rows for c in counts)


def test_through_the_engine_cold_and_with_prefix_hits(checkpoint):
    """The engine's greedy tokens are transformers' for a cold prompt, and
    again for a second prompt whose first 16 tokens (four pages) it finds
    cached."""
    hf, d = checkpoint
    llm = LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", page_size=4,
              total_pages=64, max_scheduled_tokens=16)
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    (cold,) = llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    hit_prompt = PROMPTS[0][:16] + [3, 1, 4, 1, 5]
    (hit,) = llm.generate([hit_prompt], sp, use_tqdm=False)
    assert cold.token_ids == hf_greedy(hf, PROMPTS[0], STEPS)
    assert hit.cached_tokens == 16
    assert hit.token_ids == hf_greedy(hf, hit_prompt, STEPS)
    llm.engine.planner.assert_idle()
    # the engine's stats: each sparse layer ran top_k experts for every row computed
    layers = expert_tokens(llm.model)
    assert [e.layer for e in layers] == [0, 2] and len(layers[0].tokens) == 8
    assert all(sum(e.tokens) == 2 * llm.executor.forward_tokens for e in layers)


def test_a_qwen3moe_gguf_of_the_same_weights_gives_the_same_tokens(tmp_path):
    """llama.cpp's layout: experts stacked one tensor a projection (split
    one an expert at load), every layer sparse, q/k rows not permuted."""
    hf, _ = qwen3_moe_checkpoint(tmp_path / "hf", mlp_only_layers=[])
    path = tmp_path / "q3moe.gguf"
    write_qwen3_moe_gguf(hf, path)
    model, _ = load_model(str(path), preset=None, dtype="float32", attention="torch")
    assert model.cfg.arch == "qwen3_moe" and model.cfg.moe.sparse_layers == (0, 1, 2)
    _, tokens = greedy(model, PROMPTS, STEPS)
    assert tokens == [hf_greedy(hf, p, STEPS) for p in PROMPTS]


@pytest.mark.parametrize("key,value,says", [
    ("use_sliding_window", True, "use_sliding_window is set; pdserve runs Qwen3-MoE with full"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported; pdserve runs Qwen3-MoE with"),
    ("attention_bias", True, "attention_bias is set; pdserve runs Qwen3-MoE without"),
])
def test_unsupported_qwen3_moe_variants_are_refused_by_name(checkpoint, tmp_path, key, value,
                                                             says):
    _, d = checkpoint
    raw = json.loads((d / "config.json").read_text())
    raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match=says):
        read_config(tmp_path)


def test_other_moe_families_are_refused_with_what_is_run(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}))
    with pytest.raises(ModelError, match="'MixtralForCausalLM'.*pdserve runs .*"
                                         "DeepseekV3ForCausalLM.*Qwen3MoeForCausalLM"):
        read_config(tmp_path)
