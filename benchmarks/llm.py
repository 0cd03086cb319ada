"""`pdserve.LLM` against Hugging Face `generate`, same weights, same prompts.

Greedy, every prompt the same length, every request generating the same
number of tokens (EOS ignored), side by side in one process on the same
torch threads. Tokens/s counts generated tokens over wall time, prefill
included. Needs transformers (the test extra).
"""

from __future__ import annotations

import tempfile
import time

import torch

SIZES = {
    # the tiny preset's shape
    "tiny": dict(vocab_size=98, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~110M parameters
    "llama-110m": dict(vocab_size=16000, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
}


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def main(batches=(1, 8, 32), prompt_len: int = 64, new_tokens: int = 64,
         sizes=tuple(SIZES)) -> int:
    import transformers

    from pdserve.kernels.sampling import SamplingParams
    from pdserve.llm import LLM

    rows = []
    for name in sizes:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**SIZES[name], max_position_embeddings=2048,
                                       tie_word_embeddings=False)
        hf = transformers.LlamaForCausalLM(cfg).float().eval()
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d, safe_serialization=True)
            llm = LLM({"model": {"path": d},
                       "engine": {"page_size": 16, "total_pages": 4096,
                                  "max_scheduled_tokens": 4096, "max_batch_size": 256}})
        vocab = SIZES[name]["vocab_size"]
        for b in batches:
            g = torch.Generator().manual_seed(b)
            prompts = torch.randint(3, vocab, (b, prompt_len), generator=g)
            sp = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
            llm.generate([prompts[0].tolist()], SamplingParams(max_tokens=2, temperature=0),
                         use_tqdm=False)                       # warm up
            t0 = time.perf_counter()
            outs = llm.generate([p.tolist() for p in prompts], sp, use_tqdm=False)
            ours = time.perf_counter() - t0
            assert all(len(o.token_ids) == new_tokens for o in outs)
            with torch.inference_mode():
                t0 = time.perf_counter()
                ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
                theirs = time.perf_counter() - t0
            same = sum(o.token_ids == ref[i, prompt_len:].tolist() for i, o in enumerate(outs))
            rows.append((name, _params(hf), b, b * new_tokens / ours,
                         b * new_tokens / theirs, same))
    print(f"greedy, prompt {prompt_len} tokens, {new_tokens} new tokens each, "
          f"{torch.get_num_threads()} torch threads, float32, CPU")
    print(f"{'model':<11} {'params':>7} {'batch':>5} {'pdserve tok/s':>14} {'HF tok/s':>9} "
          f"{'speedup':>8} {'same tokens':>12}")
    for name, n, b, a, h, same in rows:
        print(f"{name:<11} {n / 1e6:>6.1f}M {b:>5} {a:>14.1f} {h:>9.1f} {a / h:>7.2f}x "
              f"{same:>6}/{b}")
    return 0
