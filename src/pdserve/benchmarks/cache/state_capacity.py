"""Snapshot-state cache groups: how many long requests Qwen3-Next-80B holds.

Qwen3-Next-80B-A3B keeps K/V in 12 of its 48 layers; the other 36 (Gated
DeltaNet) keep one fixed-size state per sequence, 73.7 MiB across them. The
most requests of one prompt length a pool holds at once, served three ways:

- snapshot state (spec §1.2): the attention layers in a full-history group
  of 16-token pages holding the prompt and the decode slot
  (capacity.single_request_pages), the state layers in a state group whose
  slot holds one whole state. A decoding request holds two slots: its
  working state and the growth block reserved beyond its prompt's end (at
  least one block beyond the endpoint). Checkpoints it published and no
  longer uses are evictable cache, not held. The one prefill chunk in
  flight holds two more (its read state and checkpoint), as
  capacity.state_slots sizes the pool.
- vLLM-style (shared/research/hybrid-cache.md §1.1, §1.3): one page size for
  every layer. The attention block is raised, in multiples of the kernel
  block (16), until one layer's attention page holds one layer's state, and
  the state is padded to that page; layers are grouped by the smaller
  per-type count. Align mode holds two state blocks a request (the running
  state and the previous step's).
- every layer attention: the same model with all 48 layers keeping K/V of
  the same shape (2 KV heads of 256) and no state.

The pool is an assumption. 160 GB of bf16 weights need more than one GPU,
so the figure is a TP node's: GPUs x HBM x (1 - 10%) less the weights once,
K/V and state split evenly across the GPUs. A GPU holds at least one whole
KV head, so TP8 over 2 KV heads keeps each 4 times: `--kv-copies 4`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from pdserve.benchmarks.cache.bounds import OVERHEAD, kv_pool_bytes
from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.tables import gb
from pdserve.sim.cost.roofline import GPUS, MODELS, ModelPreset
from pdserve.scheduler.capacity import (STATE_SLOTS_PER_CHUNK, STATE_SLOTS_PER_REQUEST,
                                        single_request_pages)
from pdserve.scheduler.config import EngineConfig

MODEL, GPU, NODE = "qwen3-next-80b", "h100", 8
PAGE = 16                  # tokens per page
PROMPTS = (32 * 1024,)
VLLM_KERNEL_BLOCK = 16     # FlashAttention's kernel block (vLLM's platforms/interface.py)
VLLM_SLOTS = 2             # align mode: page x (2 + spec blocks), no speculative decoding


@dataclass(frozen=True)
class Capacity:
    cache: str               # how the model is served
    block: int               # tokens per attention page
    kv_bytes: int            # K/V one resident (decoding) request holds
    slots: int               # state slots it holds
    slot_bytes: int          # one slot (padded to the page, vLLM-style)
    requests: int            # the most resident at once

    @property
    def state_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def request_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes


def every_layer_attention(model: ModelPreset) -> ModelPreset:
    """The same model with every layer keeping K/V (same heads), no state."""
    return dataclasses.replace(model, name=f"{model.name}, every layer attention",
                               state_layers=0, state_bytes=0)


def _fit(pool_bytes: float, request_bytes: int) -> int:
    return max(0, int(pool_bytes // request_bytes))


def capacity(model: ModelPreset, pool_bytes: float, prompt: int,
             page_size: int = PAGE) -> Capacity:
    """A resident request of `prompt` tokens in pdserve's groups: its
    prompt and decode slot in the full-history group and, on a state model,
    its state slots; and how many of them `pool_bytes` holds beside the
    state slots of the chunk in flight."""
    groups = model.groups()
    pages = single_request_pages(EngineConfig(page_size=page_size), prompt)
    kv = pages * page_size * model.group_kv_bytes_per_token(groups)[0]
    state = any(g.state for g in groups)
    n = STATE_SLOTS_PER_REQUEST if state else 0
    chunk = STATE_SLOTS_PER_CHUNK * model.state_bytes if state else 0
    return Capacity("snapshot state" if n else "every layer attention", page_size, kv, n,
                    model.state_bytes, _fit(pool_bytes - chunk, kv + n * model.state_bytes))


def vllm_block(model: ModelPreset, kernel_block: int = VLLM_KERNEL_BLOCK) -> int:
    """vLLM's attention block on a state model: the smallest multiple of
    `kernel_block` whose one-layer attention page holds one layer's state."""
    layer_state = -(-model.state_bytes // model.state_layers)
    return kernel_block * -(-layer_state // (kernel_block * model.kv_layer_bytes))


def vllm_capacity(model: ModelPreset, pool_bytes: float, prompt: int,
                  kernel_block: int = VLLM_KERNEL_BLOCK, slots: int = VLLM_SLOTS) -> Capacity:
    """The same request under vLLM's hybrid allocator (module docstring):
    pages of `vllm_block` tokens a layer, a state layer's state padded to a
    page, each type's layers padded to whole groups of the smaller count."""
    block = vllm_block(model, kernel_block)
    page = block * model.kv_layer_bytes                   # one layer's page
    size = min(model.full_layers, model.state_layers)     # layers per group
    full_l = -(-model.full_layers // size) * size
    state_l = -(-model.state_layers // size) * size
    kv = single_request_pages(EngineConfig(page_size=block), prompt) * full_l * page
    slot = state_l * page
    return Capacity("vLLM-style", block, kv, slots, slot, _fit(pool_bytes, kv + slots * slot))


def main(gpu_name: str = GPU, gpus: int = NODE, prompts=PROMPTS, kv_copies: int = 1) -> int:
    model, gpu = MODELS[MODEL], GPUS[gpu_name]
    if kv_copies > 1:       # each KV head kept on kv_copies GPUs
        model = dataclasses.replace(model, kv_heads=model.kv_heads * kv_copies)
    pure = every_layer_attention(model)
    pool = kv_pool_bytes(model, gpu, gpus=gpus)
    copies = f", each KV head kept {kv_copies} times" if kv_copies > 1 else ""
    print(f"{MODEL} ({model.full_layers} full-attention layers, {model.state_layers} Gated "
          f"DeltaNet; K/V {model.kv_bytes_per_token // 1024} KiB a token{copies}; one state slot "
          f"{model.state_bytes / 2**20:.1f} MiB) on {gpus} x {gpu_name}: pool = {gpus} x "
          f"{gb(gpu.hbm_bytes)} GB HBM x {1 - OVERHEAD:.0%} - {gb(model.weight_bytes_total)} GB "
          f"bf16 weights = {gb(pool)} GB, K/V and state spread across the GPUs (assumed)")
    print()
    print(f"{'prompt':>6} {'cache':<22} {'block':>5} {'KV GB':>6} {'slots':>5} "
          f"{'slot MiB':>8} {'state GB':>8} {'GB/req':>6} {'requests':>8} {'vs pure':>7}")
    for prompt in prompts:
        rows = [capacity(model, pool, prompt), vllm_capacity(model, pool, prompt),
                capacity(pure, pool, prompt)]
        base = rows[-1].requests
        for r in rows:
            ratio = f"{r.requests / base:.2f}x" if base else "-"
            slot = f"{r.slot_bytes / 2**20:.1f}" if r.slots else "-"
            print(f"{prompt // 1024:>5}K {r.cache:<22} {r.block:>5} {gb(r.kv_bytes):>6} "
                  f"{r.slots:>5} {slot:>8} {gb(r.state_bytes):>8} {gb(r.request_bytes):>6} "
                  f"{r.requests:>8} {ratio:>7}")
    print(f"a decoding request holds its prompt and decode slot of K/V and "
          f"{STATE_SLOTS_PER_REQUEST} state slots (working state, growth block; spec §1.2), the "
          f"chunk in flight {STATE_SLOTS_PER_CHUNK} more; vLLM-style: blocks of the raised "
          f"size, {VLLM_SLOTS} padded state blocks a request (align mode)")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", choices=sorted(GPUS), default=GPU, help=f"GPU preset ({GPU})")
    p.add_argument("--gpus", type=positive, default=NODE,
                   help=f"GPUs whose memory the model and its pool share ({NODE})")
    p.add_argument("--prompt", type=positive, action="append",
                   help="prompt length in tokens, repeatable (32768)")
    p.add_argument("--kv-copies", type=positive, default=1,
                   help="GPUs keeping each KV head (1: heads split evenly; 4 for TP8 over "
                        "2 KV heads)")


def run(args) -> int:
    return main(args.gpu, args.gpus, tuple(args.prompt or PROMPTS), args.kv_copies)
