"""Small random checkpoints of each model family (with transformers, the
test oracle) and a trained byte-level tokenizer, saved the way Hugging Face
saves them, for the tests that load them."""

from __future__ import annotations

import json

import pytest
import torch

from support.planner import save_with_noisy_norms


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: `n` new tokens, no
    stop token (the oracle the model tests compare ours with)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()

transformers = pytest.importorskip("transformers")


WINDOW = 8


def gemma3_checkpoint(tmp_path, **overrides):
    """A 6-layer Gemma 3 with a global layer every third (layers 2 and 5),
    window 8, separate local and global RoPE bases. query_pre_attn_scalar 16
    (= head_dim) keeps attention sharp enough for a wrong key to show."""
    torch.manual_seed(0)
    conf = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                sliding_window=WINDOW, sliding_window_pattern=3, max_position_embeddings=512,
                query_pre_attn_scalar=16, initializer_range=0.1,
                rope_parameters={"sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 10_000.0},
                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 100_000.0}})
    conf.update(overrides)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**conf))
    model = model.float().eval()
    return save_with_noisy_norms(model, tmp_path / "gemma3")


def qwen3_5_checkpoint(d, **overrides):
    """(transformers model, `d` holding its save_pretrained): 4 layers, the
    last full attention, the others Gated DeltaNet; norms perturbed so a
    wrong state shows."""
    torch.manual_seed(0)
    conf = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_conv_kernel_dim=4, max_position_embeddings=512, initializer_range=0.1)
    conf.update(overrides)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**conf)).float().eval()
    return save_with_noisy_norms(model, d)


def lfm2_checkpoint(d, **overrides):
    """(transformers model, `d` holding its save_pretrained): 4 layers, the
    third full attention, the others short conv (with biases); norms
    perturbed so a wrong state shows."""
    torch.manual_seed(0)
    conf = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3,
                conv_bias=True, block_multiple_of=16, initializer_range=0.1)
    conf.update(overrides)
    model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(**conf)).float().eval()
    return save_with_noisy_norms(model, d)


def hf_model(tmp_path, arch: str, **overrides):
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, **overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=16))
    model = model.float().eval()
    with torch.no_grad():               # non-trivial norms, so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    d = tmp_path / arch
    model.save_pretrained(d, safe_serialization=True)
    return model, d


CORPUS = ["The quick brown fox jumps over the lazy dog.",
          "Disaggregated prefill moves the KV cache from one engine to another.",
          "Pages, tickets and leases: nothing leaks when a transfer fails.",
          "A decode engine recovers locally when its prefill peer dies."] * 20


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # the corpus is ASCII and so is every token: no id decodes to half a character
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300,
                                                        special_tokens=["<s>", "</s>"]))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", bos)])
    return tok


def save_tokenizer(tok, d) -> None:
    """`tok` in checkpoint directory `d`, as a fast tokenizer with <s> and </s>."""
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
