"""Small random mixture-of-experts checkpoints made with transformers
(the oracle): Qwen3-MoE and DeepSeek-V3, saved as Hugging Face saves them
(one tensor an expert on disk), norms perturbed so a mix-up shows; and a
Qwen3-MoE GGUF file written from the same weights as llama.cpp lays one out
(experts stacked one tensor a projection)."""

from __future__ import annotations

import numpy as np
import torch

from support.planner import save_with_noisy_norms

QWEN3_MOE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                 max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)

# yarn as DeepSeek-V3's checkpoint has it (mscale = mscale_all_dim = 1), at a
# factor small enough that 512 positions stay in range
DEEPSEEK_V3 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                   n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                   n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                   q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                   v_head_dim=12, max_position_embeddings=512, initializer_range=0.1,
                   rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                        original_max_position_embeddings=128, mscale=1.0,
                                        mscale_all_dim=1.0, beta_fast=32, beta_slow=1))


def qwen3_moe_checkpoint(d, seed: int = 0, **overrides):
    """(transformers model, `d` holding its save_pretrained)."""
    import transformers

    torch.manual_seed(seed)
    conf = {**QWEN3_MOE, **overrides}
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**conf))
    return save_with_noisy_norms(model.float().eval(), d)


def deepseek_v3_checkpoint(d, seed: int = 0, **overrides):
    """(transformers model, `d`): the correction bias random (it is zero
    at init), so it steers the choice as a trained one does."""
    import transformers

    torch.manual_seed(seed)
    conf = {**DEEPSEEK_V3, **overrides}
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**conf))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.2)
    return save_with_noisy_norms(model.float().eval(), d)


def write_qwen3_moe_gguf(hf, path) -> None:
    """`hf`'s weights as a qwen3moe GGUF file (float32), llama.cpp's names
    and metadata; tokens named t0, t1, ... (ids in, ids out)."""
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_tokenizer_model("none")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate": "ffn_gate_inp"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_name, name in names.items():
            w.add_tensor(f"blk.{i}.{name}.weight", sd[f"{p}{hf_name}.weight"])
        gate_up = sd[f"{p}mlp.experts.gate_up_proj"]            # [E, 2I, H], gate first
        inter = gate_up.shape[1] // 2
        w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(gate_up[:, :inter]))
        w.add_tensor(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(gate_up[:, inter:]))
        w.add_tensor(f"blk.{i}.ffn_down_exps.weight", sd[f"{p}mlp.experts.down_proj"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
