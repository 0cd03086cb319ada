"""A mixture-of-experts model's tensors split over tensor-parallel ranks,
where they differ from the Llama family's split (kernels/tensor_parallel.py
does the rest: the embedding, the LM head, a Qwen3-MoE's q/k/v/o).

Experts, two ways:
- split (the default): every rank holds every expert, a slice of its width
  (gate and up rows, down columns, moe_intermediate / T each), and runs
  every chosen expert on its slice;
- sharded (expert parallelism, `model.expert_parallel`): rank r holds
  experts [r E/T, (r+1) E/T) whole, and runs only those, over the tokens
  that chose them.
Either way a rank's MLP output is a partial sum the ranks all-reduce, and
the router (replicated) makes the same choice on every rank. A shared
expert (DeepSeek) is split by width in both, its part added before the
one all-reduce. DeepSeek's latent attention splits by head: q_b (or q_proj)
and kv_b by rows of the rank's heads, o_proj by their columns; q_a,
kv_a_proj_with_mqa and their norms are replicated, so every rank computes
and caches the same latent entries (the cache is the same on every rank)."""

from __future__ import annotations

import re

import torch

from pdserve.kernels.models.moe.specs import MoeSpec

_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_SHARED = re.compile(r"model\.layers\.\d+\.mlp\.shared_experts\.(gate|up|down)_proj\.weight")
DROP = object()           # a tensor this rank does not hold (another rank's expert)


def local_experts(moe: MoeSpec, size: int, rank: int, expert_parallel: bool) -> range:
    """The routed experts rank `rank` holds: all, or its share under EP."""
    if not expert_parallel:
        return range(moe.num_experts)
    per = moe.num_experts // size
    return range(rank * per, (rank + 1) * per)


def _width(w: torch.Tensor, proj: str, size: int, rank: int) -> torch.Tensor:
    """A gated MLP's slice: gate/up rows, down columns."""
    n = (w.shape[1] if proj == "down" else w.shape[0]) // size
    part = slice(rank * n, (rank + 1) * n)
    return w[:, part] if proj == "down" else w[part]


def _heads(w: torch.Tensor, per_head: int, heads: range, columns: bool = False) -> torch.Tensor:
    part = slice(heads.start * per_head, heads.stop * per_head)
    return w[:, part] if columns else w[part]


def shard_moe_tensor(cfg, name: str, w: torch.Tensor, size: int, rank: int, heads: range,
                     expert_parallel: bool):
    """Rank `rank`'s part of tensor `name` of a MoE model `cfg` (whole),
    DROP when another rank holds it, or None where the Llama family's
    split applies (`heads`: the rank's query heads)."""
    m = _EXPERT.fullmatch(name)
    if m is not None:
        if expert_parallel:
            mine = local_experts(cfg.moe, size, rank, True)
            return w if int(m.group(1)) in mine else DROP
        return _width(w, m.group(2), size, rank)
    m = _SHARED.fullmatch(name)
    if m is not None:
        return _width(w, m.group(1), size, rank)
    mla = cfg.mla
    if mla is None:
        return None
    if name.endswith(("q_b_proj.weight", "self_attn.q_proj.weight")):
        return _heads(w, mla.qk_head_dim, heads)
    if name.endswith("kv_b_proj.weight"):
        return _heads(w, mla.qk_nope_head_dim + mla.v_head_dim, heads)
    if name.endswith("self_attn.o_proj.weight"):
        return _heads(w, mla.v_head_dim, heads, columns=True)
    if name.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
        return w                       # replicated: the latent is every rank's
    return None


def check_moe_split(moe: MoeSpec, size: int, expert_parallel: bool) -> str | None:
    """Why `size` ranks cannot split these experts (None: they can)."""
    if expert_parallel and moe.num_experts % size:
        return (f"expert parallelism over {size} ranks does not divide the model's "
                f"{moe.num_experts} experts; use a size that does")
    if not expert_parallel and moe.intermediate % size:
        return (f"tensor_parallel_size {size} does not divide the experts' width "
                f"{moe.intermediate}; use a size that does, or model.expert_parallel: true")
    if moe.shared_intermediate % size:
        return (f"tensor_parallel_size {size} does not divide the shared expert's width "
                f"{moe.shared_intermediate}; use a size that does")
    return None


def shard_moe_spec(moe: MoeSpec, size: int, rank: int, expert_parallel: bool) -> MoeSpec:
    """What one rank's experts are: its share of the experts, or every
    expert at its slice of the width; the shared expert at its slice."""
    import dataclasses

    mine = local_experts(moe, size, rank, expert_parallel)
    return dataclasses.replace(
        moe, intermediate=moe.intermediate if expert_parallel else moe.intermediate // size,
        shared_intermediate=moe.shared_intermediate // size,
        first_local=mine.start, local_count=len(mine))
