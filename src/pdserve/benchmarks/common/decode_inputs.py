"""A decode round's inputs built by hand, with no planner or executor:
`batch` rows, each the next token of a `context`-token history in pages of
its own. What the benchmarks that time a model's forward (`bench
quantized`, `bench lora`, `bench capture`) or ship a round to other ranks
(`bench tp-plan`) feed it."""

from __future__ import annotations


def decode_meta(batch: int, context: int, page: int = 16, device="cpu"):
    """(ids, meta): row i's pages are i * per .. (i + 1) * per - 1, per =
    pages of context + 1; its one query row at position `context`."""
    import torch

    from pdserve.kernels.attention import BatchMeta, SeqMeta

    per = -(-(context + 1) // page)
    seqs, slots = [], []
    for i in range(batch):
        table = list(range(i * per, (i + 1) * per))
        seqs.append(SeqMeta(i, 1, context + 1, table))
        slots.append(table[context // page] * page + context % page)
    meta = BatchMeta(seqs, torch.tensor(slots, device=device),
                     torch.full((batch,), context, device=device), num_decodes=batch)
    ids = torch.arange(batch, device=device) + 1
    return ids, meta


def decode_round(model, batch: int, context: int, page: int = 16):
    """(ids, meta, cache, logits rows) for `model`: decode_meta's round and
    a cache of its pages (the cache's values do not matter to the time)."""
    import torch

    ids, meta = decode_meta(batch, context, page, model.device)
    cache = model.new_cache(batch * -(-(context + 1) // page), page)
    return ids, meta, cache, torch.arange(batch, device=model.device)
