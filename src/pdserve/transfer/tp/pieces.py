"""Per-rank KV transfer between tensor-parallel engines: which P rank sends
which KV heads to which D rank, and how each such piece crosses a page.
Pure: no NIXL, no torch; transfer/tp/rank_agent.py turns it into descriptors,
prepared once per peer.

A rank's page of one cache group is `[layers, 2, page_size, heads, head_dim]`
of its own heads (`heads_of`); latent attention's is `[layers, 1, page_size,
1, latent + rotary key]`, its one "head" held whole by every rank, so a P
of any size sends each D rank one copy (from P rank `j mod p`) and never
packs or unpacks. For each D rank j and each model KV head h it
holds, one P rank holding h sends it; a head replicated on several P ranks
(P's size above the KV heads) is sent by the replica `j mod replicas`, so
D's ranks spread their reads over P's. The heads one P rank sends one D
rank, contiguous, are a `KvPiece`.

A piece crosses as one block per page, `[layers, 2, page_size, its heads,
head_dim]`, one NIXL descriptor: a rank's page is token-major (each token's
heads side by side), so a head sub-range of it is one run per (layer, K/V,
token), and UCX posts every descriptor as its own operation (about 9 µs
each here: 64 a page for the tiny model, 960 for a 30-layer one). So the
side whose page holds other heads too packs (P: a local strided copy into a
registered send slot) or unpacks (D: the blocks land side by side in the
destination page itself, and D's rank rearranges that page in place once
every block of it landed): `PieceWire`.

Bytes per rank (`bytes_per_rank`): over n pages of B bytes (the whole
page, every head), from a P of size p to a D of size d, each D rank
receives B·n/d (B·n/KV heads when D replicates a head) and P's ranks send
exactly that, B·n/p each when P's heads are split (a replicated head's
bytes shared by its replicas): nothing passes through either rank 0 beyond
its own shard."""

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
class PieceWire:
    """How a piece crosses, per page of one cache group: its heads as one
    block `[layers, 2, page_size, count, head_dim]` of `length` bytes.
    `p_packed`: P's page holds other heads too, so the block is packed from
    it into a send slot first (a local strided copy on P's rank); else it is
    P's page itself. `d_packed`: D's page holds other heads too, so the
    block lands at `d_offset` in D's page (D's page is read as its heads'
    blocks one after another until D's rank unpacks it, in place, once
    every block of it landed); else it is D's page itself."""
    length: int
    p_packed: bool
    d_packed: bool
    d_offset: int


def piece_wire(piece: KvPiece, p: KvLayout, d: KvLayout, group: int, itemsize: int) -> PieceWire:
    plane = p.layers[group] * p.parts * p.page_size * p.head_dim * itemsize   # one head's block
    return PieceWire(piece.count * plane, piece.count != len(heads_of(p, piece.p_rank)),
                     piece.count != len(heads_of(d, piece.d_rank)),
                     piece.d_first * plane if piece.count != len(heads_of(d, piece.d_rank))
                     else 0)


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
            b = n * piece_wire(piece, p, d, g, itemsize).length
            sent[piece.p_rank] += b
            received[piece.d_rank] += b
    return RankBytes(tuple(sent), tuple(received))
