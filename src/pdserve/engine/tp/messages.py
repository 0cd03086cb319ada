"""What rank 0 of a tensor-parallel engine sends its other ranks, one
message at a time, in order, over a pipe per rank: the caches to allocate
once, then each round's forward as the planner's plan made it (the tokens,
their positions, every sequence's block table and K/V slots per cache
group, the rows that sample), and the stop. The other ranks hold no
planner, no clock and no peer: everything that depends on time or I/O was
decided on rank 0 before the message was made, so a rank's only input is
this stream, and its view of a round is the message's bytes (`digest`).

A round goes as flat numpy arrays, not per-sequence objects: one pickle of
a few arrays, whatever the batch (docs/benchmarks.md measures it at 1, 64
and 256 running requests)."""

from __future__ import annotations

import enum
import hashlib
from itertools import chain
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta


@dataclass(frozen=True)
class TpStarted:
    """A rank, to rank 0, first of all: it runs (the program's main module
    re-run, main_module.py), so rank 0 may wait for it in the group."""
    rank: int


@dataclass(frozen=True)
class TpReady:
    """A rank, to rank 0: its shard is loaded (or `error`: why not)."""
    rank: int
    error: str | None = None


@dataclass(frozen=True)
class TpCaches:
    """Allocate the KV caches: `pages` per cache group, of `page_size`."""
    pages: tuple
    page_size: int


@dataclass(frozen=True)
class TpGroupRound:
    """One cache group's part of a round: per sequence its first row, rows,
    keys and first key read; the block tables end to end (`table_ends`
    cuts them); each row's K/V slot; the group's window; the rows whose
    K/V are written when some are not."""
    q_start: np.ndarray
    q_len: np.ndarray
    ctx_len: np.ndarray
    kv_start: np.ndarray
    tables: np.ndarray
    table_ends: np.ndarray
    slots: np.ndarray
    num_decodes: int
    window: int | None
    write_rows: np.ndarray | None

    @classmethod
    def of(cls, meta: BatchMeta) -> "TpGroupRound":
        seqs = meta.seqs
        tables = [s.block_table for s in seqs]
        lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
        flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
        return cls(np.fromiter((s.q_start for s in seqs), np.int32, len(seqs)),
                   np.fromiter((s.q_len for s in seqs), np.int32, len(seqs)),
                   np.fromiter((s.ctx_len for s in seqs), np.int32, len(seqs)),
                   np.fromiter((s.kv_start for s in seqs), np.int32, len(seqs)),
                   flat, np.cumsum(lens), _host(meta.slot_mapping), meta.num_decodes,
                   meta.window, None if meta.write_rows is None else _host(meta.write_rows))

    def meta(self, positions: torch.Tensor, device) -> BatchMeta:
        starts = np.concatenate(([0], self.table_ends[:-1])).astype(np.int64)
        seqs = [SeqMeta(int(q0), int(n), int(ctx), self.tables[a:b].tolist(), int(kv))
                for q0, n, ctx, kv, a, b in zip(self.q_start, self.q_len, self.ctx_len,
                                                self.kv_start, starts, self.table_ends)]
        rows = None if self.write_rows is None else torch.from_numpy(self.write_rows).to(device)
        return BatchMeta(seqs, torch.from_numpy(self.slots).to(device), positions,
                         num_decodes=self.num_decodes, window=self.window, write_rows=rows)


@dataclass(frozen=True)
class TpForward:
    """One round's forward on every rank. `check`: the ranks compare
    digests of their views after it (engine.tensor_parallel_check)."""
    round: int
    ids: np.ndarray
    positions: np.ndarray
    logits_rows: np.ndarray
    groups: tuple
    check: bool = False

    @classmethod
    def of(cls, round_: int, ids: torch.Tensor, metas: list, logits_rows: torch.Tensor,
           check: bool = False) -> "TpForward":
        return cls(round_, _host(ids), _host(metas[0].positions), _host(logits_rows),
                   tuple(TpGroupRound.of(m) for m in metas), check)

    def inputs(self, device) -> tuple:
        """(ids, metas, logits rows) on `device`, as the model's forward takes them."""
        pos = torch.from_numpy(self.positions).to(device)
        return (torch.from_numpy(self.ids).to(device), [g.meta(pos, device) for g in self.groups],
                torch.from_numpy(self.logits_rows).to(device))


class TpPageMoveKind(enum.Enum):
    GATHER = "gather"           # every rank's heads of the pages to rank 0 (inspection: tests)


@dataclass(frozen=True)
class TpPageMove:
    """Meet rank 0 in a gather of `pages` of cache group `group`: every
    rank's heads of them, to see a TP engine's KV whole (tests; KV moves
    between engines rank to rank, engine/tp/kv_ranks.py)."""
    kind: TpPageMoveKind
    group: int
    pages: np.ndarray


@dataclass(frozen=True)
class TpStop:
    """Rank 0 is going: close the process group and exit."""


def digest(payload: bytes) -> int:
    """A rank's view of a round as one signed 64-bit number (what the
    ranks compare under engine.tensor_parallel_check)."""
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little",
                          signed=True)


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
