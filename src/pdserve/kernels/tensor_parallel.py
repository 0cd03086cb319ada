"""Tensor parallelism inside one engine: how a model splits across T ranks,
each rank's shard of the weights, and the collectives its forward calls.

The split is Megatron's. Query heads are divided evenly (rank r holds heads
[r * H/T, (r+1) * H/T)); KV heads too while T <= KV, else each KV head is
held by T/KV ranks, every rank holding the one its query heads read (the
grouped-query map sends query head h to KV head h // (H/KV)). q, k, v, gate
and up are column-parallel (a rank's rows of the weight), o and down
row-parallel (its columns): their partial outputs are summed across ranks
(`all_reduce`). The embedding and the LM head are vocabulary-parallel: a
rank holds V/T rows (the last padded with zeros), a lookup sums the one rank
that owns each token's row, and the logits are gathered and cut to V. Norms,
rotary tables and biases of row-parallel layers are replicated.

Each rank's KV cache holds its heads of every page under the same page ids
(the shard's `ModelConfig` has the per-rank head counts), so the planner's
block tables mean the same on every rank.

Sharded families: the Llama family (llama, mistral, qwen2), Gemma 3, and
the MoE families, Qwen3-MoE and DeepSeek-V3 (their experts split by width or
sharded whole, and latent attention by head: kernels/models/moe/sharding.py;
a latent cache has one entry, a replicated "KV head", on every rank). The
hybrids (Qwen3.5's Gated DeltaNet, LFM2's short convs) keep per-sequence
state whose split is not built: `tp_layout` refuses them by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pdserve.kernels.models.model_config import ModelConfig, ModelError
from pdserve.kernels.models.moe.sharding import (DROP, check_moe_split, shard_moe_spec,
                                                 shard_moe_tensor)

SHARDED = ("llama", "mistral", "qwen2", "gemma3", "qwen3_moe", "deepseek_v3")
MEET_S = 600.0          # the longest the ranks wait for each other to start
NOT_SHARDED = {
    "qwen3_5": "Qwen3.5's Gated DeltaNet layers keep a recurrent state per value head "
               "whose split across ranks is not built",
    "lfm2": "LFM2's short-conv layers keep a conv state over the hidden size whose split "
            "across ranks is not built",
}


class TpError(ModelError):
    """A model or size tensor parallelism cannot run; says what to change."""


class TpLost(RuntimeError):
    """A rank of a tensor-parallel engine died, stopped, or timed out in a
    collective: the engine cannot go on and must go down as one unit."""


@dataclass(frozen=True)
class TpLayout:
    """How a model of `cfg` splits over `size` ranks (see the module doc)."""
    size: int
    heads: int              # query heads per rank
    kv_heads: int           # KV heads per rank
    kv_replicas: int        # ranks holding each KV head (1: KV heads split)
    intermediate: int       # MLP width per rank
    vocab_rows: int         # embedding / LM head rows per rank (the last rank's padded)
    vocab_size: int
    expert_parallel: bool = False   # a MoE's experts sharded whole over the ranks (moe/sharding.py)

    def q_heads_of(self, rank: int) -> range:
        return range(rank * self.heads, (rank + 1) * self.heads)

    def kv_heads_of(self, rank: int) -> range:
        """The model's KV heads rank `rank` holds (replicated: one, shared
        with the `kv_replicas` - 1 ranks beside it)."""
        first = rank // self.kv_replicas * self.kv_heads
        return range(first, first + self.kv_heads)

    def vocab_of(self, rank: int) -> tuple[int, int]:
        """[start, end) of the vocabulary rank `rank` holds (end may be
        before start + vocab_rows: the padding)."""
        start = rank * self.vocab_rows
        return start, min(start + self.vocab_rows, self.vocab_size)


def tp_layout(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> TpLayout:
    """The split of `cfg` over `size` ranks, or a TpError saying why not.
    `expert_parallel`: a MoE's experts sharded whole, not each one split."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TpError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if size > 1 and cfg.arch in NOT_SHARDED:
        raise TpError(f"tensor_parallel_size {size} with a {cfg.arch} model: "
                      f"{NOT_SHARDED[cfg.arch]}; use tensor_parallel_size 1 for it")
    if size > 1 and cfg.arch not in SHARDED:
        raise TpError(f"tensor_parallel_size {size}: the {cfg.arch} family is not sharded; "
                      f"sharded families: {', '.join(SHARDED)}")
    h, kv = cfg.num_heads, cfg.num_kv_heads
    if h % size:
        raise TpError(f"tensor_parallel_size {size} does not divide the model's {h} query "
                      "heads; use a size that does")
    if kv % size and size % kv:
        raise TpError(f"tensor_parallel_size {size} and the model's {kv} KV heads: one must "
                      "divide the other (KV heads are split, or replicated across ranks)")
    dense = cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_layers
    if dense and cfg.intermediate_size % size:
        raise TpError(f"tensor_parallel_size {size} does not divide the model's MLP width "
                      f"{cfg.intermediate_size}; use a size that does")
    if expert_parallel and cfg.moe is None:
        raise TpError(f"model.expert_parallel with a {cfg.arch} model: it has no experts; "
                      "leave expert_parallel out")
    why = check_moe_split(cfg.moe, size, expert_parallel) if cfg.moe is not None else None
    if why:
        raise TpError(why)
    replicas = max(size // kv, 1)
    return TpLayout(size, h // size, max(kv // size, 1), replicas,
                    cfg.intermediate_size // size, -(-cfg.vocab_size // size), cfg.vocab_size,
                    expert_parallel)


def shard_config(cfg: ModelConfig, layout: TpLayout, rank: int = 0) -> ModelConfig:
    """What rank `rank`'s model is: its heads and MLP width, a MoE's experts
    (its share, or every one at its slice). The vocabulary stays the
    model's (the logits are gathered whole)."""
    moe = shard_moe_spec(cfg.moe, layout.size, rank, layout.expert_parallel) \
        if cfg.moe is not None else None
    return dataclasses.replace(cfg, num_heads=layout.heads, num_kv_heads=layout.kv_heads,
                               intermediate_size=layout.intermediate, moe=moe)


def shard_weights(cfg: ModelConfig, weights: dict, layout: TpLayout, rank: int) -> dict:
    """Rank `rank`'s shard of `weights` (Hugging Face names, whole)."""
    d = cfg.head_dim
    q = layout.q_heads_of(rank)
    kv = layout.kv_heads_of(rank)
    qs, kvs = slice(q.start * d, q.stop * d), slice(kv.start * d, kv.stop * d)
    inter = slice(rank * layout.intermediate, (rank + 1) * layout.intermediate)
    out = {}
    for name, w in weights.items():
        part = shard_moe_tensor(cfg, name, w, layout.size, rank, q, layout.expert_parallel) \
            if cfg.moe is not None else None
        if part is DROP:
            continue
        if part is not None:
            out[name] = part
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _vocab_rows(w, layout, rank)
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            out[name] = w[qs]
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            out[name] = w[kvs]
        elif name.endswith("o_proj.weight"):
            out[name] = w[:, qs]
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = w[inter]
        elif name.endswith("down_proj.weight"):
            out[name] = w[:, inter]
        else:                       # norms: replicated
            out[name] = w
    return {k: v.contiguous() for k, v in out.items()}


def _vocab_rows(w: torch.Tensor, layout: TpLayout, rank: int) -> torch.Tensor:
    start, end = layout.vocab_of(rank)
    rows = w[start:end]
    pad = layout.vocab_rows - rows.shape[0]
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    return rows


class TpComm:
    """One rank's membership in its engine's process group: the tensor
    collectives of the forward (gloo on CPU, NCCL on CUDA), each bounded by
    `timeout_s`, so a rank that stops takes the others down with a TpLost
    instead of hanging them."""

    def __init__(self, rank: int, size: int, init_method: str, device: torch.device,
                 timeout_s: float):
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s
        backend = "nccl" if device.type == "cuda" else "gloo"
        self._timeout = timedelta(seconds=timeout_s)
        # meeting waits for every rank's start (torch's import, minutes on a
        # busy host); each collective after it waits `timeout_s` at most
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=max(timeout_s, MEET_S)))
        self.group = dist.group.WORLD
        # a CPU group beside NCCL, for what is compared on the host (digests)
        self.cpu_group = self.group if backend == "gloo" else dist.new_group(backend="gloo")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            dist.all_reduce(x, group=self.group, async_op=True).wait(self._timeout)
        except RuntimeError as e:
            raise TpLost(f"rank {self.rank}: all_reduce across {self.size} ranks failed: "
                         f"{e}") from e
        return x

    def all_gather(self, x: torch.Tensor, group=None) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x.contiguous(), group=group or self.group,
                            async_op=True).wait(self._timeout)
        except RuntimeError as e:
            raise TpLost(f"rank {self.rank}: all_gather across {self.size} ranks failed: "
                         f"{e}") from e
        return parts

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape) on rank 0, in rank order; [] elsewhere."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(x.contiguous(), parts, dst=0, group=self.group,
                        async_op=True).wait(self._timeout)
        except RuntimeError as e:
            raise TpLost(f"rank {self.rank}: gather across {self.size} ranks failed: "
                         f"{e}") from e
        return parts or []

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None) -> torch.Tensor:
        """`out` = rank 0's `parts[rank]` (rank 0 passes one part per rank,
        the others None)."""
        try:
            dist.scatter(out, [p.contiguous() for p in parts] if parts else None, src=0,
                         group=self.group, async_op=True).wait(self._timeout)
        except RuntimeError as e:
            raise TpLost(f"rank {self.rank}: scatter across {self.size} ranks failed: "
                         f"{e}") from e
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class TpShard:
    """What a sharded model's forward calls at the three places ranks meet:
    the vocabulary-parallel lookup, the row-parallel sums, the logits."""

    def __init__(self, comm: TpComm, layout: TpLayout):
        self.comm = comm
        self.layout = layout
        self.vocab_start, self.vocab_end = layout.vocab_of(comm.rank)

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the whole embedding for `ids`: each rank looks up the ids
        it holds (zeros for the rest) and the ranks' rows are summed."""
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        h = weight[local] * mine.unsqueeze(-1).to(weight.dtype)
        return self.comm.all_reduce(h)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: the ranks' partial sums, summed."""
        return self.comm.all_reduce(x)

    def logits(self, h: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Every rank's logits over the whole vocabulary."""
        parts = self.comm.all_gather(F.linear(h, lm_head))
        return torch.cat(parts, dim=-1)[:, :self.layout.vocab_size]


def check_roles(model: ModelConfig, serve_cfg) -> None:
    """Every role's tensor-parallel size splits `model` (a serving config's
    roles; TpError names the role otherwise)."""
    for role in ("fused", "prefill", "decode"):
        if getattr(serve_cfg.cluster, role):
            t = serve_cfg.cluster.tp_size(role, serve_cfg.engine.tensor_parallel_size)
            try:
                tp_layout(model, t, serve_cfg.model.expert_parallel)
            except TpError as e:
                raise TpError(f"cluster.{role}: {e}") from None
