"""`pdserve bench moe`: a small mixture-of-experts model against the dense
model of the same active parameters, decode tokens/s at batch 1 and 32 on
CPU through `pdserve.LLM`, and what splitting the MoE over two
tensor-parallel ranks costs, each expert split by width against the
experts sharded whole (`model.expert_parallel`).

Both checkpoints are written here from seeded random weights (float32,
config.json + safetensors; no transformers): the MoE is Qwen3-MoE-shaped
(`--experts` experts, top `--top-k`, each `--expert-width` wide), the dense
model a Llama of the same hidden size, layers and attention whose MLP is
top_k x expert_width wide, so a token passes through the same number of
parameters. Decode tokens/s is taken from two runs of the same batch of
fresh 8-token prompts, one token and 1 + `--decode` tokens: the extra
tokens over the extra time (prefill and the first token cancel)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.benchmarks.common.options import positive

SHAPE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
             rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32",
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=positive, default=32)
    p.add_argument("--top-k", type=positive, default=4)
    p.add_argument("--expert-width", type=positive, default=256)
    p.add_argument("--batches", type=positive, nargs="+", default=[1, 32])
    p.add_argument("--decode", type=positive, default=32, help="decode steps timed (32)")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--no-tp", action="store_true", help="TP 1 rows only")


def _shapes(cfg: dict, moe: bool) -> dict:
    """Every tensor's shape under its Hugging Face name."""
    h, hd, v = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
           "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if not moe:
            w = cfg["intermediate_size"]
            out |= {p + "mlp.gate_proj.weight": (w, h), p + "mlp.up_proj.weight": (w, h),
                    p + "mlp.down_proj.weight": (h, w)}
            continue
        w = cfg["moe_intermediate_size"]
        out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate.weight": (cfg["num_experts"], h)}
        for e in range(cfg["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            out |= {x + "gate_proj.weight": (w, h), x + "up_proj.weight": (w, h),
                    x + "down_proj.weight": (h, w)}
    return out


def write_checkpoint(d: Path, cfg: dict, moe: bool, seed: int = 0) -> int:
    """config.json and model.safetensors of seeded random weights; the
    parameter count."""
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _shapes(cfg, moe).items():
        tensors[name] = torch.ones(shape) if len(shape) == 1 else \
            torch.randn(shape, generator=g) * shape[-1] ** -0.5
    save_file(tensors, str(d / "model.safetensors"))
    return sum(t.numel() for t in tensors.values())


def configs(experts: int, top_k: int, width: int) -> dict:
    moe = {**SHAPE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
           "intermediate_size": top_k * width, "norm_topk_prob": True}
    dense = {**SHAPE, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "intermediate_size": top_k * width}
    return {"dense": dense, "moe": moe}


def decode_tokens_per_s(llm, batch: int, decode: int, repeats: int, seed: int) -> float:
    """The median over `repeats` of decode tokens/s at `batch` requests."""
    from pdserve import SamplingParams

    def timed(n: int, k: int) -> float:
        prompts = [[(seed * 7919 + k * 131 + i * 17 + j * 3) % 4000 + 1 for j in range(8)]
                   for i in range(batch)]              # fresh each run: no prefix hits
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed(2, -1)                                        # warm
    rates = []
    for k in range(repeats):
        one, more = timed(1, 2 * k), timed(1 + decode, 2 * k + 1)
        rates.append(batch * decode / max(more - one, 1e-9))
    return statistics.median(rates)


def run(args) -> int:
    from pdserve import LLM

    cfgs = configs(args.experts, args.top_k, args.expert_width)
    rows = [("dense", 1, False), ("moe", 1, False)]
    if not args.no_tp:
        rows += [("dense", 2, False), ("moe", 2, False), ("moe", 2, True)]
    with tempfile.TemporaryDirectory() as tmp:
        params = {name: write_checkpoint(Path(tmp) / name, cfg, name == "moe")
                  for name, cfg in cfgs.items()}
        idle = args.experts - args.top_k           # experts a token does not run, a layer
        moe_active = params["moe"] - SHAPE["num_hidden_layers"] * idle * 3 * \
            SHAPE["hidden_size"] * args.expert_width
        print(f"decode tokens/s on CPU (float32, torch attention), median of {args.repeats}; "
              f"dense: {params['dense'] / 1e6:.1f}M parameters; MoE: {params['moe'] / 1e6:.1f}M, "
              f"{moe_active / 1e6:.1f}M active ({args.experts} experts, top {args.top_k}, "
              f"width {args.expert_width})")
        print(f"{'model':<6} {'TP':>3} {'experts':>9} " +
              "".join(f"{f'batch {b}':>12}" for b in args.batches))
        for i, (name, tp, ep) in enumerate(rows):
            model = {"path": str(Path(tmp) / name), "dtype": "float32", "attention": "torch",
                     "expert_parallel": ep}
            llm = LLM({"model": model}, tensor_parallel_size=tp, page_size=16,
                      total_pages=2048, max_batch_size=64, max_scheduled_tokens=512)
            try:
                rates = [decode_tokens_per_s(llm, b, args.decode, args.repeats, i)
                         for b in args.batches]
            finally:
                llm.close()
            how = "-" if name == "dense" or tp == 1 else ("sharded" if ep else "split")
            print(f"{name:<6} {tp:>3} {how:>9} " + "".join(f"{r:>12.1f}" for r in rates),
                  flush=True)
    return 0
