"""Per-rank KV transfer between tensor-parallel engines: which P rank sends
which KV heads to which D rank, and the byte runs of a page each such piece
is made of. Pure: no NIXL, no torch; transfer/rank_agent.py turns the runs
into descriptors, prepared once per peer.

A rank's page of one cache group is `[layers, 2, page_size, heads, head_dim]`
of its own heads (`heads_of`). For each D rank j and each model KV head h it
holds, one P rank holding h sends it; a head replicated on several P ranks
(P's size above the KV heads) is sent by the replica `j mod replicas`, so
D's ranks spread their reads over P's. The heads one P rank sends one D
rank, contiguous, are a `KvPiece`.

A piece's bytes in a page: when it covers every head of the page on both
sides (equal sizes, or a size-1 engine against a size-1 one) it is the whole
page, one run; otherwise the heads are a strided sub-range of each token's
row, one run per (layer, K/V, token) of `heads x head_dim` elements. That
is what NIXL's descriptor lists express without a gather kernel: a run is
one contiguous (address, length) on each side.

Bytes per rank: over n pages of B bytes (the whole page, every head), a P
of size p and a D of size d, each P rank sends and each D rank receives
B·n/max(p, d)-style shares (B·n/d each D rank; B·n/p each P rank when the
heads are split on P; replicas share their head's bytes) — nothing passes
through either rank 0 beyond its own shard."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.transfer.kv_layout import KvLayout


def heads_of(layout: KvLayout, rank: int) -> range:
    """The model's KV heads rank `rank` of an engine of `layout` holds: a
    contiguous share while the size divides the heads, else the one head it
    shares with size / heads - 1 other ranks (kernels/tensor_parallel.py)."""
    size, kv = layout.tensor_parallel_size, layout.kv_heads
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} of an engine of tensor_parallel_size {size}")
    if size <= kv:
        if kv % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {kv} KV heads")
        per = kv // size
        return range(rank * per, (rank + 1) * per)
    if size % kv:
        raise ValueError(f"tensor_parallel_size {size} is not a multiple of {kv} KV heads")
    h = rank // (size // kv)
    return range(h, h + 1)


@dataclass(frozen=True, order=True)
class KvPiece:
    """Heads [first, first + count) of the model, from P rank `p_rank` (its
    local heads from `p_first`) to D rank `d_rank` (from `d_first`)."""
    p_rank: int
    d_rank: int
    first: int
    count: int
    p_first: int
    d_first: int

    @property
    def name(self) -> str:
        return f"{self.p_rank}>{self.d_rank}"


def plan_pieces(p: KvLayout, d: KvLayout) -> list[KvPiece]:
    """Every (P rank, D rank) piece of a transfer from an engine of layout
    `p` to one of layout `d` (their KV geometry already checked equal)."""
    if p.kv_heads != d.kv_heads:
        raise ValueError(f"P has {p.kv_heads} KV heads, D {d.kv_heads}: no map between them")
    kv = p.kv_heads
    p_replicas = max(p.tensor_parallel_size // kv, 1)
    out: list[KvPiece] = []
    for j in range(d.tensor_parallel_size):
        mine = heads_of(d, j)
        for h in mine:
            if p.tensor_parallel_size <= kv:
                i = h // (kv // p.tensor_parallel_size)
            else:
                i = h * p_replicas + j % p_replicas
            last = out[-1] if out else None
            if last is not None and last.p_rank == i and last.d_rank == j and \
                    last.first + last.count == h:
                out[-1] = KvPiece(i, j, last.first, last.count + 1, last.p_first, last.d_first)
            else:
                out.append(KvPiece(i, j, h, 1, h - heads_of(p, i).start, h - mine.start))
    return out


@dataclass(frozen=True)
class PageGeometry:
    """One cache group's page on a rank: [layers, 2, page_size, heads, head_dim]."""
    layers: int
    page_size: int
    heads: int                  # this rank's
    head_dim: int
    itemsize: int

    @property
    def page_bytes(self) -> int:
        return self.layers * 2 * self.page_size * self.heads * self.head_dim * self.itemsize

    def runs(self, first: int, count: int, whole: bool = True) -> list[tuple[int, int]]:
        """(offset, length) in bytes, within a page, of local heads
        [first, first + count): one run per (layer, K/V, token), or (with
        `whole`) the whole page when they are all its heads."""
        if first < 0 or first + count > self.heads or count < 1:
            raise ValueError(f"heads [{first}, {first + count}) of a page of {self.heads}")
        if whole and count == self.heads:
            return [(0, self.page_bytes)]
        row = self.heads * self.head_dim * self.itemsize
        head = self.head_dim * self.itemsize
        return [(r * row + first * head, count * head)
                for r in range(self.layers * 2 * self.page_size)]


def geometry(layout: KvLayout, rank: int, group: int, itemsize: int) -> PageGeometry:
    return PageGeometry(layout.layers[group], layout.page_size, len(heads_of(layout, rank)),
                        layout.head_dim, itemsize)


def piece_runs(piece: KvPiece, p: KvLayout, d: KvLayout, group: int,
               itemsize: int) -> tuple[list, list]:
    """(P's runs, D's runs) of `piece` in a page of cache group `group`,
    pairwise of equal length: the whole page when the piece is every head
    of the page on both sides, else one run per (layer, K/V, token) on both."""
    pg, dg = geometry(p, piece.p_rank, group, itemsize), geometry(d, piece.d_rank, group, itemsize)
    whole = piece.count == pg.heads == dg.heads
    return (pg.runs(piece.p_first, piece.count, whole),
            dg.runs(piece.d_first, piece.count, whole))


@dataclass(frozen=True)
class RankBytes:
    """Bytes a transfer moves per rank: what each P rank sends and each D
    rank receives (every byte straight rank to rank)."""
    sent: tuple
    received: tuple


def bytes_per_rank(p: KvLayout, d: KvLayout, pages_per_group, itemsize: int) -> RankBytes:
    """What moving `pages_per_group[g]` pages of each group costs each rank."""
    sent = [0] * p.tensor_parallel_size
    received = [0] * d.tensor_parallel_size
    for piece in plan_pieces(p, d):
        for g, n in enumerate(pages_per_group):
            b = n * sum(length for _, length in piece_runs(piece, p, d, g, itemsize)[0])
            sent[piece.p_rank] += b
            received[piece.d_rank] += b
    return RankBytes(tuple(sent), tuple(received))
