"""What a prefill or decode engine's transport moves, and how: its
`KvLayout` (the model's whole KV geometry and the engine's size), and
`register_transfer_pools`, which registers the executor's pools and, in a
deployment with a tensor-parallel prefill or decode role, gives every rank
of every P and D engine its own NIXL agent over its shard so that KV moves
rank to rank (transfer/tp/pieces.py, rank_agent.py, rank_writes.py;
engine/tp/kv_ranks.py for a tensor-parallel engine's workers)."""

from __future__ import annotations

from pdserve.transfer.kv_layout import KvLayout


def kv_layout(model, executor, page_size: int) -> KvLayout:
    """This engine's KvLayout: the model's whole KV geometry, its size."""
    caches = [executor.caches[g] for g in executor.kv]
    shard = caches[0].shapes[0]
    tp = model.model.tp if getattr(model, "tensor_parallel", False) else None
    size, heads = 1, shard.kv_heads
    if tp is not None:
        size = tp.layout.size
        heads = tp.layout.kv_heads * size // tp.layout.kv_replicas
    draft = tuple(c.companion.describe(page_size) if c.companion is not None else ""
                  for c in caches)
    return KvLayout(size, heads, shard.head_dim,
                    str(caches[0].data.dtype).removeprefix("torch."), page_size,
                    tuple(c.shapes[0].layers for c in caches),
                    draft if any(draft) else (), shard.parts)


def register_transfer_pools(transport, model, executor, page_size: int,
                            per_rank: bool = False) -> None:
    """Register the executor's pools with `transport`, with the engine's
    KvLayout. With `per_rank` (a deployment with a tensor-parallel prefill
    or decode role; always at size > 1), every rank its own agent over its
    shard too: a size-1 engine's `LocalRanks`, a tensor-parallel one's
    `TpKvRanks` (its workers' agents driven over their pipes)."""
    layout = kv_layout(model, executor, page_size)
    if layout.draft and (per_rank or layout.tensor_parallel_size > 1):
        raise ValueError("a draft model's layers in the pages with tensor parallelism (or "
                         "per-rank KV transfer) are not built; leave engine.speculative's "
                         "draft model out of a deployment with a tensor-parallel role")
    if executor.state is not None and (per_rank or layout.tensor_parallel_size > 1):
        raise ValueError("state layers with tensor parallelism (or per-rank KV transfer) are "
                         "not built")
    transport.register_pools(executor.transfer_pools(), layout=layout)
    if not per_rank and layout.tensor_parallel_size == 1:
        return
    name = transport.incarnation.agent_name
    if layout.tensor_parallel_size == 1:
        from pdserve.transfer.tp.rank_agent import LocalRanks

        transport.use_ranks(LocalRanks(name, executor.transfer_pools(), layout))
    else:
        from pdserve.engine.tp.kv_ranks import TpKvRanks

        transport.use_ranks(TpKvRanks(model, name, layout))
