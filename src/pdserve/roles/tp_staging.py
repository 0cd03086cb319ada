"""P/D for tensor-parallel engines: whole pages staged on rank 0.

A rank of a tensor-parallel engine holds its KV heads of every page; the
wire carries whole pages (transfer/kv_layout.py), so engines of any two
sizes meet. `TpStaging` keeps on rank 0 a staging pool of whole pages, one
per cache group, under the same page ids as the ranks' caches, and the
engine's transport registers it instead of rank 0's shard:

    P: write(src)  -> gather: each rank's heads of src over the TP group into
                      the staging pages, then the one NIXL write of whole pages
    D: landed(dst) -> scatter: each rank's heads of the landed staging pages
                      over the TP group, before D's planner sees the landing

This is not yet the per-rank design the issue asks for (each D rank reading
the heads it owns from the P ranks that hold them, NIXL descriptors per rank
pair): every byte of a transfer passes through both rank 0s, the staging
pool doubles rank 0's KV memory, and the gather runs on P's loop thread
before the write is posted. docs/tensor-parallel.md says what remains and
docs/benchmarks.md measures the bytes each rank moves.

Replicated KV heads (size > KV heads) are gathered from the first rank of
each replica set, and scattered to every rank of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kernels.kv_cache import KVCache
from pdserve.transfer.kv_layout import KvLayout


@dataclass
class TpStagingBytes:
    """What a staged transfer moved, per rank of this engine (rank 0's
    share of its own heads moves inside its memory and counts too)."""
    gathered: list = field(default_factory=list)    # per rank: its heads sent to rank 0 (P)
    scattered: list = field(default_factory=list)   # per rank: its heads received (D)


class TpStaging:
    """Rank 0's whole-page pools and the gather and scatter over them."""

    def __init__(self, leader, page_size: int):
        layout = leader.model.tp.layout
        self.leader = leader
        self.size = layout.size
        self.replicas = layout.kv_replicas
        self.kv_heads = layout.kv_heads * layout.size // layout.kv_replicas
        self.heads_of = [layout.kv_heads_of(r) for r in range(layout.size)]
        self.pools = [KVCache(c.data.shape[1], c.data.shape[0], page_size, self.kv_heads,
                              c.data.shape[-1], c.data.dtype, c.data.device)
                      for c in leader.caches]
        self.bytes = TpStagingBytes([0] * self.size, [0] * self.size)

    def gather(self, transport, page_ids) -> None:
        """The staging pages of `page_ids` (transport ids) = every rank's heads of them."""
        for g, pages in _by_group(transport, page_ids).items():
            parts = self.leader.gather_pages(g, pages)
            whole = torch.cat(parts[::self.replicas], dim=-2)
            self.pools[g].data[torch.tensor(pages)] = whole
            for r, p in enumerate(parts):
                self.bytes.gathered[r] += p.nbytes

    def scatter(self, transport, page_ids) -> None:
        """Each rank's heads of `page_ids` (transport ids) = the staging pages'."""
        for g, pages in _by_group(transport, page_ids).items():
            whole = self.pools[g].data[torch.tensor(pages)]
            parts = [whole[..., h.start:h.stop, :].contiguous() for h in self.heads_of]
            self.leader.scatter_pages(g, pages, parts)
            for r, p in enumerate(parts):
                self.bytes.scattered[r] += p.nbytes


def _by_group(transport, page_ids) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pid in page_ids:
        g, p = transport.locate(pid)
        out.setdefault(g, []).append(p)
    return out


def kv_layout(model, executor, page_size: int) -> KvLayout:
    """This engine's KvLayout: the model's whole KV geometry, its size."""
    caches = [executor.caches[g] for g in executor.kv]
    shard = caches[0].data
    tp = model.model.tp if getattr(model, "tensor_parallel", False) else None
    size, heads = 1, shard.shape[-2]
    if tp is not None:
        size = tp.layout.size
        heads = tp.layout.kv_heads * size // tp.layout.kv_replicas
    return KvLayout(size, heads, shard.shape[-1], str(shard.dtype).removeprefix("torch."),
                    page_size, tuple(c.data.shape[1] for c in caches))


def register_transfer_pools(transport, model, executor, page_size: int,
                            per_rank: bool = False) -> TpStaging | None:
    """Register what `transport` moves, with the engine's KvLayout. With
    `per_rank` (a deployment with a tensor-parallel prefill or decode
    role): the executor's pools (rank 0's shard), and every rank its own
    agent over its shard (roles/tp_kv_ranks.py; transfer/rank_agent.py).
    Else the executor's pools at size 1, and a tensor-parallel engine's
    whole-page staging pools (their TpStaging returned) at size > 1."""
    layout = kv_layout(model, executor, page_size)
    if executor.state is not None and layout.tensor_parallel_size > 1:
        raise ValueError("state layers under tensor parallelism are not built")
    if per_rank:
        transport.register_pools(executor.transfer_pools(), layout=layout)
        name = transport.incarnation.agent_name
        if layout.tensor_parallel_size == 1:
            from pdserve.transfer.rank_agent import LocalRanks

            transport.use_ranks(LocalRanks(name, executor.transfer_pools(), layout))
        else:
            from pdserve.roles.tp_kv_ranks import TpKvRanks

            transport.use_ranks(TpKvRanks(model, name, layout))
        return None
    if layout.tensor_parallel_size == 1:
        transport.register_pools(executor.transfer_pools(), layout=layout)
        return None
    staging = TpStaging(model, page_size)
    transport.register_pools([p.data for p in staging.pools], layout=layout, staging=staging)
    return staging
