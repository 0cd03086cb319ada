"""The bounds the cache benchmarks measure against, which none of them
owns: the bytes GPUs have for KV once the weights and a share of HBM are
set aside (`bench cache-groups`, `bench state-capacity`), and the prefix
hits a trace allows a cache that keeps everything (`bench state-reuse`,
`bench disk --sim`)."""

from __future__ import annotations

from pdserve.sim.cost.roofline import GpuPreset, ModelPreset

OVERHEAD = 0.10            # of HBM: activations, CUDA graphs, allocator slack
HASH_BLOCK = 512           # tokens a Mooncake hash id stands for


def kv_pool_bytes(model: ModelPreset, gpu: GpuPreset, overhead: float = OVERHEAD,
                  gpus: int = 1) -> float:
    """What `gpus` GPUs have for KV together: their HBM less the weights
    (held once, sharded across them) and `overhead` of HBM."""
    return gpus * gpu.hbm_bytes * (1 - overhead) - model.weight_bytes_total


def ideal_hit(trace, block_tokens: int = HASH_BLOCK) -> tuple[int, int]:
    """(prompt tokens, tokens of each prompt's longest prefix of hash
    blocks some earlier request had): what a cache that kept everything,
    at any token, could skip. A hit leaves the prompt's last token."""
    seen: set = set()
    hit = total = 0
    for t in trace:
        ids, length = t.prompt.hash_ids, len(t.prompt)
        n = 0
        while n < len(ids) and tuple(ids[:n + 1]) in seen:
            n += 1
        hit += min(n * block_tokens, length - 1)
        total += length
        seen.update(tuple(ids[:k + 1]) for k in range(len(ids)))
    return total, hit
