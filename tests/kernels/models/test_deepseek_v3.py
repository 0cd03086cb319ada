"""DeepSeek-V3 (DeepseekV3ForCausalLM): latent attention over a cache of
one entry a token and layer, grouped top-k experts with a correction bias
and a shared expert, the first layer dense, YaRN rotary, all against
transformers on small random checkpoints: greedy tokens and logits through
the forward (decode absorbed and expanded), through the engine cold and
with prefix hits; the query and rotary variants; the variants refused."""

import dataclasses
import json

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels.models.loader import load_model
from pdserve.kernels.models.model_config import ModelError, read_config
from support.checkpoints import hf_greedy
from support.moe import deepseek_v3_checkpoint
from support.tp import greedy

transformers = pytest.importorskip("transformers")

PROMPTS = [[(7 * i + 3) % 120 + 1 for i in range(23)], [5, 9, 11, 60]]
STEPS = 8
TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return deepseek_v3_checkpoint(tmp_path_factory.mktemp("deepseek_v3"))


def ours(d):
    return load_model(str(d), preset=None, dtype="float32", attention="torch")[0]


def test_the_cache_keeps_one_latent_entry_a_token_and_layer(checkpoint):
    """kv_lora_rank 32 + qk_rope_head_dim 8: 40 values a token and layer,
    one part, no heads; the softmax scale is 24 ** -0.5 times YaRN's
    mscale(4, 1) squared."""
    _, d = checkpoint
    cfg = read_config(d)
    assert cfg.arch == "deepseek_v3" and (cfg.num_kv_heads, cfg.head_dim, cfg.kv_parts) == (1, 40, 1)
    assert cfg.moe.sparse_layers == (1, 2) and cfg.moe.shared_intermediate == 16
    m = 0.1 * torch.log(torch.tensor(4.0)).item() + 1
    assert cfg.mla.softmax_scale == pytest.approx(24 ** -0.5 * m * m)
    cache = ours(d).new_caches([5], 4)[0]
    assert cache.data.shape == (5, 3, 1, 4, 1, 40) and cache.layer(0)[1] is None
    assert cache.data[0].nbytes == 3 * 4 * 40 * 4


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
def test_greedy_tokens_and_logits_match_transformers(checkpoint, absorb):
    hf, d = checkpoint
    model = ours(d)
    model.mla.absorb = absorb
    logits, tokens = greedy(model, PROMPTS, STEPS)
    assert tokens == [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[1] + tokens[1]])).logits[0, -1]
    assert (logits[-1][1] - want).abs().max() < TOL
    rows = sum(len(p) for p in PROMPTS) + len(PROMPTS) * STEPS
    assert [int(e.counts.sum()) for e in model.expert_layers()] == [3 * rows] * 2


def test_through_the_engine_cold_and_with_prefix_hits(checkpoint):
    """Chunks of 8 over latent pages of 4 tokens; the second prompt finds
    its first 16 tokens cached."""
    hf, d = checkpoint
    llm = LLM({"model": {"path": str(d)}}, dtype="float32", attention="torch", page_size=4,
              total_pages=64, max_scheduled_tokens=8)
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    hit_prompt = PROMPTS[0][:16] + [3, 1, 4, 1, 5]
    (cold,) = llm.generate([PROMPTS[0]], sp, use_tqdm=False)
    (hit,) = llm.generate([hit_prompt], sp, use_tqdm=False)
    assert cold.token_ids == hf_greedy(hf, PROMPTS[0], STEPS)
    assert hit.cached_tokens == 16 and hit.token_ids == hf_greedy(hf, hit_prompt, STEPS)
    llm.engine.planner.assert_idle()


@pytest.mark.parametrize("variant", [
    dict(q_lora_rank=None),                        # queries from one projection (V2-Lite's)
    dict(rope_interleave=False),
    dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0), n_group=1, topk_group=1),
], ids=["q-proj", "rope-halves", "plain-rope-one-group"])
def test_query_rotary_and_group_variants_match_transformers(tmp_path, variant):
    hf, d = deepseek_v3_checkpoint(tmp_path, **variant)
    _, tokens = greedy(ours(d), PROMPTS, 4)
    assert tokens == [hf_greedy(hf, p, 4) for p in PROMPTS]


@pytest.mark.parametrize("key,value,says", [
    ("scoring_func", "softmax", "scoring_func 'softmax' is not supported; pdserve runs "
                                "DeepSeek-V3's router with 'sigmoid'"),
    ("topk_method", "greedy", "topk_method 'greedy' is not supported"),
    ("attention_bias", True, "attention_bias is set; pdserve runs DeepSeek-V3's latent"),
    ("n_group", 3, "n_routed_experts 8 is not a multiple of n_group 3"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]},
     "quantization_config 'fp8': pdserve loads DeepSeek-V3 checkpoints stored in float32"),
])
def test_unsupported_deepseek_variants_are_refused_by_name(checkpoint, tmp_path, key, value,
                                                            says):
    _, d = checkpoint
    raw = json.loads((d / "config.json").read_text())
    raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match=says):
        read_config(tmp_path)


def test_a_bfloat16_model_keeps_the_router_in_float32(checkpoint):
    _, d = checkpoint
    model = load_model(str(d), preset=None, dtype="bfloat16", attention="torch")[0]
    (first, *_) = model.expert_layers()
    assert first.router.dtype == first.bias.dtype == torch.float32
    assert model.layers[0].attn.kv_b.dtype == torch.bfloat16
    assert dataclasses.asdict(model.cfg.mla)["kv_lora_rank"] == 32
