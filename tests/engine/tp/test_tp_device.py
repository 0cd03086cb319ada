"""TP 2 against TP 1 on GPUs: decode inter-token latency and tokens/s on
the same model (a Llama of about 1B parameters, random weights, bfloat16;
SmolLM2-135M's 9 query heads do not split by 2), and the same first greedy
tokens (a split changes the sums' order, so bfloat16 may part later). Needs two CUDA GPUs (NCCL
refuses two ranks on one): `pytest -m device tests/engine/tp/test_tp_device.py`.
Not run yet: no machine with two GPUs was lent while it was written."""

import time

import pytest
import torch

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.device

PROMPTS = [[(7 * i + j) % 30000 + 1 for j in range(200)] for i in range(32)]
DECODE = 128


def _timed(llm: LLM) -> tuple[float, float, list]:
    """(median inter-token seconds of one request alone, batch tokens/s, the
    alone request's tokens)."""
    one = SamplingParams(temperature=0.0, max_tokens=DECODE, ignore_eos=True)
    llm.generate(PROMPTS[:1], one, use_tqdm=False)              # warm
    t0 = time.perf_counter()
    alone = llm.generate(PROMPTS[:1], one, use_tqdm=False)[0].token_ids
    itl = (time.perf_counter() - t0) / DECODE
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, one, use_tqdm=False)
    tps = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    return itl, tps, alone


def _llama_1b(tmp_path) -> str:
    """A Llama of about 1B parameters with random weights (16 query heads,
    8 KV heads: both split by 2), saved as safetensors."""
    transformers = pytest.importorskip("transformers")
    conf = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                    num_hidden_layers=16, num_attention_heads=16,
                                    num_key_value_heads=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(conf).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "llama", safe_serialization=True)
    return str(tmp_path / "llama")


def test_tp2_against_tp1_decode_itl_and_throughput(tmp_path):
    assert torch.cuda.device_count() >= 2, "needs two CUDA GPUs (NCCL: one rank a GPU)"
    config = {"model": {"path": _llama_1b(tmp_path), "dtype": "bfloat16", "device": "cuda"}}
    tp1 = LLM(config, total_pages=4096)
    itl1, tps1, tokens1 = _timed(tp1)
    tp1.close()
    del tp1
    tp2 = LLM(config, total_pages=4096, tensor_parallel_size=2)
    try:
        itl2, tps2, tokens2 = _timed(tp2)
    finally:
        tp2.close()
    print(f"\nTP 1: ITL {itl1 * 1e3:.2f} ms, {tps1:.0f} tokens/s; "
          f"TP 2: ITL {itl2 * 1e3:.2f} ms, {tps2:.0f} tokens/s")
    assert tokens2[:8] == tokens1[:8]
