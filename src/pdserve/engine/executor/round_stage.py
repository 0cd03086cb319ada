"""A round's forward inputs, as the executor stages them: the flat batch
of a plan's rows (prefill chunks, then verify rows, then plain decodes),
each cache group's slots and sequence metadata, the state group's reads
and writes, the LoRA segments, and the decode inputs a launched round
takes from the last round's sampled tensor on the device. Every list goes
to the device in one copy (`stage_rows`). What comes out (`StagedRound`)
crosses to the forward thread with engine.overlap; nothing in it reads
planner state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta
from pdserve.kernels.lora.batched import BatchedLora, LoraSegments
from pdserve.kernels.lora.fused import lora_round as make_lora_round
from pdserve.kernels.staging import stage_rows
from pdserve.kernels.models.state_cache import SeqState, StateBatch
from pdserve.engine.spec.round import SpecRound
from pdserve.scheduler.cache.groups import HOLE
from pdserve.scheduler.plan import Plan


@dataclass(frozen=True)
class FedFromDevice:
    """Decode inputs taken from the last launched round's sampled tokens."""
    to: torch.Tensor        # rows of this round's ids
    frm: torch.Tensor       # rows of the sampled tensor
    tokens: torch.Tensor    # that tensor


@dataclass(frozen=True)
class LoraInputs:
    rnd: BatchedLora        # a LoraRound, or on CUDA with triton a FusedLoraRound
    needs: dict             # LoRA slot -> the adapter load its rows run under


@dataclass(frozen=True)
class StagedRound:
    ids: torch.Tensor               # [T] the rows' token ids
    rows: torch.Tensor              # the rows whose logits are wanted
    metas: list                     # a BatchMeta per page group
    states: StateBatch | None       # the state group's, if any
    fed: FedFromDevice | None
    lora: LoraInputs | None

    @property
    def fed_rows(self) -> int:
        return 0 if self.fed is None else int(self.fed.to.numel())


class _RoundRows:
    """The host lists of one round's rows as they are added: token ids,
    positions, each cache group's slots and sequences, the state group's
    reads and writes, LoRA slots, and which rows sample."""

    def __init__(self, ex, own_tables: bool):
        self.ex = ex
        self.own_tables = own_tables
        self.groups = [ex.groups[g] for g in ex.kv]
        n = len(self.groups)
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.sample_rows: list[int] = []
        self.rows: list = []                # the requests of the rows that sample
        self.seqs: list[list[SeqMeta]] = [[] for _ in range(n)]
        self.slots: list[list[int]] = [[] for _ in range(n)]
        self.skips = [False] * n            # a group some replay rows do not write
        self.states: list[SeqState] = []
        self.fed_to: list[int] = []
        self.fed_from: list[int] = []
        self.verify_rows: list[int] = []
        self.row_slots: list[int] = []      # each row's LoRA slot (-1: base), with adapters
        self.needs: dict[int, int] = {}     # LoRA slot -> the adapter load its rows run under

    def _table(self, table: list) -> list:
        return list(table) if self.own_tables else table

    def _lora(self, req, n: int) -> None:
        if self.ex.adapters is not None:
            self.row_slots.extend([req.lora_slot] * n)
            if req.lora_slot >= 0:
                self.needs[req.lora_slot] = req.adapter

    def prefill(self, op) -> None:
        """A prefill chunk's rows: its replay rows, then its new tokens."""
        ex, ps, req = self.ex, self.ex.page_size, op.req
        toks = req.prompt.tokens + req.output
        begin, end = op.begin - op.replay, op.begin + op.tokens
        self._lora(req, end - begin)
        q0 = len(self.ids)
        self.ids.extend(toks[begin:end])
        self.pos.extend(range(begin, end))
        tables = req.state.res.tables
        for g, spec in enumerate(self.groups):
            table = tables[ex.kv[g]]
            # replay rows' K/V go only where the group regenerates them
            keeps = not op.replay or spec.replayable
            first = begin if keeps else op.begin
            kv_start = 0
            if spec.sliding:
                kv_start = begin if op.replay and spec.replayable \
                    else max(begin - spec.window + 1, 0)
                check_live(table, kv_start, end, ps, req, g)
            self.seqs[g].append(SeqMeta(q0, end - begin, end, self._table(table), kv_start))
            if not keeps:
                self.slots[g].extend([-1] * op.replay)
                self.skips[g] = True
            self.slots[g].extend(table[p // ps] * ps + p % ps for p in range(first, end))
        if ex.state is not None:
            self.states.append(seq_state(ex._blocks, req, tables[ex.state], begin, end))
        if op.completes:
            self.sample_rows.append(len(self.ids) - 1)
            self.rows.append(req)

    def decode(self, req, drafts, fed_row: int | None) -> None:
        """A decode's row, and its verify rows if it carries `drafts`;
        `fed_row`: its input token is that row of the last round's sampled
        tensor on the device."""
        ex, ps = self.ex, self.ex.page_size
        p = req.num_tokens - 1
        m = 1 + len(drafts)
        tables = req.state.res.tables
        for g, spec in enumerate(self.groups):
            table = tables[ex.kv[g]]
            kv_start = 0
            if spec.sliding:
                kv_start = max(p - spec.window + 1, 0)
                check_live(table, kv_start, p + m, ps, req, g)
            self.seqs[g].append(SeqMeta(len(self.ids), m, p + m, self._table(table), kv_start))
            self.slots[g].extend(table[q // ps] * ps + q % ps for q in range(p, p + m))
        if ex.state is not None:
            self.states.append(seq_state(ex._blocks, req, tables[ex.state], p, p + 1))
        self._lora(req, m)
        if fed_row is not None:
            self.fed_to.append(len(self.ids))
            self.fed_from.append(fed_row)
        self.ids.append(req.output[-1] if req.output else req.prompt.tokens[-1])
        self.pos.extend(range(p, p + m))
        if drafts:
            self.ids.extend(drafts)
            self.verify_rows.extend(range(len(self.ids) - m, len(self.ids)))
        else:
            self.sample_rows.append(len(self.ids) - 1)
            self.rows.append(req)

    def stage(self, plan: Plan, feed) -> StagedRound:
        """Every list to the device in one (asynchronous) copy, and the
        forward's inputs made from them."""
        ex, groups = self.ex, self.groups
        n = len(groups)
        writes = [[i for i, s in enumerate(sl) if s >= 0] if skip else []
                  for sl, skip in zip(self.slots, self.skips)]
        lists = [self.ids, self.pos, self.sample_rows, *self.slots, *writes]
        segments = LoraSegments.of(self.row_slots) if self.needs else None
        if segments is not None:
            lists += segments.lists()
        if self.fed_to:
            lists += [self.fed_to, self.fed_from]
        staged = stage_rows(lists, ex.model.device)
        ids_t, pos_t, rows_t = staged[:3]
        verifies = len(plan.verify)
        metas = [BatchMeta(self.seqs[g], staged[3 + g], pos_t,
                           num_decodes=len(plan.decodes) - verifies,
                           num_verifies=verifies,
                           window=spec.window if spec.sliding else None,
                           write_rows=staged[3 + n + g] if self.skips[g] else None)
                 for g, spec in enumerate(groups)]
        states = StateBatch(ex.caches[ex.state], self.states) if ex.state is not None \
            else None
        fed = None
        if self.fed_to:
            assert feed is not None         # fed_to is filled from it
            fed = FedFromDevice(staged[-2], staged[-1], feed[0])
        lora = LoraInputs(make_lora_round(ex.model.lora, segments, staged[3 + 2 * n:]),
                          self.needs) if segments is not None else None
        return StagedRound(ids_t, rows_t, metas, states, fed, lora)


def stage_round(ex, plan: Plan, feed=None, own_tables: bool = False) -> tuple:
    """The forward's inputs on the device (a StagedRound), the requests of
    the rows that sample, and the round's verify rows (a SpecRound, or
    None); `ex` is the TorchExecutor. `feed`: (the last launched round's sampled tokens on the
    device, request id -> row): a decode found there takes its input
    token from it. `own_tables`: copy the block tables, which the next
    round's build may change while this forward runs."""
    r = _RoundRows(ex, own_tables)
    for op in plan.prefills:
        r.prefill(op)
    fed = feed[1] if feed is not None else {}
    verify = plan.verify
    # verify rows first: attention batches the trailing one-token rows (spec_round.py)
    decodes = [q for q in plan.decodes if q.id in verify] + \
        [q for q in plan.decodes if q.id not in verify] if verify else plan.decodes
    for req in decodes:
        r.decode(req, verify.get(req.id, ()) if verify else (), fed.get(req.id))
    spec_round = None
    if verify:
        assert ex.spec is not None
        r.sample_rows += r.verify_rows
        pairs = [(q, verify[q.id]) for q in decodes if q.id in verify]
        spec_round = SpecRound(pairs, ex.spec.rows(pairs, ex.tracked))
    return r.stage(plan, feed), r.rows, spec_round


def seq_state(blocks, req, table: list, begin: int, end: int) -> SeqState:
    """Where a forward over [begin, end) finds its state and leaves it
    (spec §1.2): the slot the planner gave the state after `begin`
    tokens, the one for `end`, and the checkpoint between if any.
    `blocks`: the state group's StateBlocks."""
    grp = blocks
    assert grp is not None      # called only for a model with a state group
    read = table[grp.entry(begin)] if begin else -1
    b = grp.checkpoint(begin, end)
    ckpt = (b - begin, table[grp.entry(b)]) if b else None
    seq = SeqState(read, table[grp.entry(end)], ckpt)
    if HOLE in (seq.write_slot, ckpt[1] if ckpt else 0) or (begin and read == HOLE):
        raise RuntimeError(f"request {req.id}: its state table {table} lacks a slot the "
                           f"forward over [{begin}, {end}) reads or writes")
    return seq


def check_live(table, kv_start: int, end: int, ps: int, req, g: int) -> None:
    """A sliding group's forward reads and writes slots [kv_start // ps,
    end / ps): none of them may be a page the group let go."""
    live = table[kv_start // ps: -(-end // ps)]
    if HOLE in live or len(live) < -(-end // ps) - kv_start // ps:
        raise RuntimeError(f"request {req.id}: cache group {g}'s table {table} lacks a page "
                           f"in slots [{kv_start // ps}, {-(-end // ps)}) that the forward "
                           f"over positions [{kv_start}, {end}) reads")
