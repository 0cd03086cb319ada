"""RoPE scaling a checkpoint declares (`rope_scaling`), against Hugging Face
transformers on the same weights: `linear` everywhere, `dynamic` up to the
model's context, where it is the unscaled rotation; past that context
transformers would rescale, and pdserve refuses the request instead."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from support.checkpoints import hf_greedy

transformers = pytest.importorskip("transformers")

CONTEXT = 64                     # max_position_embeddings: small, so the tests reach its end
ENGINE = {"page_size": 4, "total_pages": 128, "max_scheduled_tokens": 16}   # chunked, paged
PROMPTS = [[5, 17, 42, 9, 3, 77, 12, 8, 30, 2, 61, 40, 7],
           list(range(1, 40)),
           [(7 * i) % 250 + 3 for i in range(56)]]


def checkpoint(tmp_path, scaling):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_scaling=scaling)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    d = tmp_path / ((scaling or {}).get("rope_type") or "default")
    model.save_pretrained(d, safe_serialization=True)
    return model, d


def ours_greedy(d, prompts, n):
    llm = LLM({"model": {"path": str(d)}, "engine": ENGINE})
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_linear_scaling_matches_transformers(tmp_path):
    model, d = checkpoint(tmp_path, {"rope_type": "linear", "factor": 4.0})
    want = [hf_greedy(model, p, 8) for p in PROMPTS]
    assert ours_greedy(d, PROMPTS, 8) == want
    # and the factor matters: the same weights unscaled generate other tokens
    plain, _ = checkpoint(tmp_path, None)
    assert [hf_greedy(plain, p, 8) for p in PROMPTS] != want


def test_dynamic_scaling_matches_transformers_to_the_last_position_of_the_context(tmp_path):
    model, d = checkpoint(tmp_path, {"rope_type": "dynamic", "factor": 4.0})
    # the longest prompt generates up to position CONTEXT - 1, the last one there is
    want = [hf_greedy(model, p, CONTEXT - len(PROMPTS[-1])) for p in PROMPTS]
    assert ours_greedy(d, PROMPTS, CONTEXT - len(PROMPTS[-1])) == want


def test_dynamic_scaling_beyond_the_original_context_is_refused_with_the_limit(tmp_path):
    model, d = checkpoint(tmp_path, {"rope_type": "dynamic", "factor": 4.0})
    llm = LLM({"model": {"path": str(d)}, "engine": ENGINE})
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match=f"model context {CONTEXT}"):
        llm.generate([list(range(1, CONTEXT + 6))], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"lower max_new_tokens to at most 8"):
        llm.generate([PROMPTS[-1]], SamplingParams(max_tokens=12, ignore_eos=True),
                     use_tqdm=False)
    # what pdserve declines to serve is where dynamic scaling would change the
    # rotation: transformers' logits there differ from its unscaled twin's
    plain, _ = checkpoint(tmp_path, None)
    long = torch.tensor([list(range(1, CONTEXT + 6))])
    assert torch.allclose(model(long[:, :CONTEXT]).logits, plain(long[:, :CONTEXT]).logits)
    assert not torch.allclose(model(long).logits, plain(long).logits)


@pytest.mark.parametrize("params", [
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    {"factor": 4.0},                                   # attention factor from the factor alone
    {"factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
], ids=["deepseek-v3", "plain", "untruncated"])
def test_yarn_frequencies_and_attention_factor_are_transformers(params):
    """YaRN (DeepSeek-V3's and Qwen's long context) over a 64-dim rotary
    head: the same inverse frequencies and cos/sin factor as
    transformers' _compute_yarn_parameters."""
    import dataclasses

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pdserve.kernels.models.model_config import tiny_config
    from pdserve.kernels.models.rope import inv_freq

    rope = {"rope_type": "yarn", "rope_theta": 10000.0,
            "original_max_position_embeddings": 4096, **params}
    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                  max_position_embeddings=163840, rope_parameters=rope)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = dataclasses.replace(tiny_config(), head_dim=64, max_position=163840,
                              rope_scaling=rope)
    got, factor = inv_freq(cfg)
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and factor == pytest.approx(want_factor)
