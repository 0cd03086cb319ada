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


def stage_round(ex, plan: Plan, feed=None, own_tables: bool = False) -> tuple:
    """The forward's inputs on the device (a StagedRound), the requests of
    the rows that sample, and the round's verify rows (a SpecRound, or
    None); `ex` is the TorchExecutor. `feed`: (the last launched round's sampled tokens on the
    device, request id -> row): a decode found there takes its input
    token from it. `own_tables`: copy the block tables, which the next
    round's build may change while this forward runs."""
    ps = ex.page_size
    groups = [ex.groups[g] for g in ex.kv]
    ids: list[int] = []
    pos: list[int] = []
    sample_rows, rows = [], []
    seqs: list[list[SeqMeta]] = [[] for _ in groups]
    slots: list[list[int]] = [[] for _ in groups]
    skips = [False] * len(groups)
    states = []
    fed_to: list[int] = []
    fed_from: list[int] = []
    lora = ex.adapters
    row_slots: list[int] = []           # each row's LoRA slot (-1: base), with adapters
    needs: dict[int, int] = {}          # LoRA slot -> the adapter load its rows run under
    for op in plan.prefills:
        req = op.req
        toks = req.prompt.tokens + req.output
        begin, end = op.begin - op.replay, op.begin + op.tokens
        if lora is not None:
            row_slots.extend([req.lora_slot] * (end - begin))
            if req.lora_slot >= 0:
                needs[req.lora_slot] = req.adapter
        q0 = len(ids)
        ids.extend(toks[begin:end])
        pos.extend(range(begin, end))
        tables = req.state.res.tables
        for g, spec in enumerate(groups):
            table = tables[ex.kv[g]]
            # replay rows' K/V go only where the group regenerates them
            keeps = not op.replay or spec.replayable
            first = begin if keeps else op.begin
            kv_start = 0
            if spec.sliding:
                kv_start = begin if op.replay and spec.replayable \
                    else max(begin - spec.window + 1, 0)
                check_live(table, kv_start, end, ps, req, g)
            seqs[g].append(SeqMeta(q0, end - begin, end,
                                   list(table) if own_tables else table, kv_start))
            if not keeps:
                slots[g].extend([-1] * op.replay)
                skips[g] = True
            slots[g].extend(table[p // ps] * ps + p % ps for p in range(first, end))
        if ex.state is not None:
            states.append(seq_state(ex._blocks, req, tables[ex.state], begin, end))
        if op.completes:
            sample_rows.append(len(ids) - 1)
            rows.append(req)
    fed = feed[1] if feed is not None else {}
    verify = plan.verify
    # verify rows first: attention batches the trailing one-token rows (spec_round.py)
    decodes = [r for r in plan.decodes if r.id in verify] + \
        [r for r in plan.decodes if r.id not in verify] if verify else plan.decodes
    verify_rows: list[int] = []
    for req in decodes:
        p = req.num_tokens - 1
        drafts = verify.get(req.id, ()) if verify else ()
        m = 1 + len(drafts)
        tables = req.state.res.tables
        for g, spec in enumerate(groups):
            table = tables[ex.kv[g]]
            kv_start = 0
            if spec.sliding:
                kv_start = max(p - spec.window + 1, 0)
                check_live(table, kv_start, p + m, ps, req, g)
            seqs[g].append(SeqMeta(len(ids), m, p + m,
                                   list(table) if own_tables else table, kv_start))
            slots[g].extend(table[q // ps] * ps + q % ps for q in range(p, p + m))
        if ex.state is not None:
            states.append(seq_state(ex._blocks, req, tables[ex.state], p, p + 1))
        if lora is not None:
            row_slots.extend([req.lora_slot] * m)
            if req.lora_slot >= 0:
                needs[req.lora_slot] = req.adapter
        row = fed.get(req.id)
        if row is not None:
            fed_to.append(len(ids))
            fed_from.append(row)
        ids.append(req.output[-1] if req.output else req.prompt.tokens[-1])
        pos.extend(range(p, p + m))
        if drafts:
            ids.extend(drafts)
            verify_rows.extend(range(len(ids) - m, len(ids)))
        else:
            sample_rows.append(len(ids) - 1)
            rows.append(req)
    spec_round = None
    if verify:
        assert ex.spec is not None
        sample_rows += verify_rows
        pairs = [(r, verify[r.id]) for r in decodes if r.id in verify]
        spec_round = SpecRound(pairs, ex.spec.rows(pairs, ex.tracked))
    writes = [[i for i, s in enumerate(sl) if s >= 0] if skip else []
              for sl, skip in zip(slots, skips)]
    # one host tensor, one (asynchronous) copy for the round's lists
    lists = [ids, pos, sample_rows, *slots, *writes]
    segments = LoraSegments.of(row_slots) if needs else None
    if segments is not None:
        lists += segments.lists()
    if fed_to:
        lists += [fed_to, fed_from]
    staged = stage_rows(lists, ex.model.device)
    ids_t, pos_t, rows_t = staged[:3]
    n = len(groups)
    metas = [BatchMeta(seqs[g], staged[3 + g], pos_t,
                       num_decodes=len(plan.decodes) - len(verify),
                       num_verifies=len(verify),
                       window=spec.window if spec.sliding else None,
                       write_rows=staged[3 + n + g] if skips[g] else None)
             for g, spec in enumerate(groups)]
    states_b = StateBatch(ex.caches[ex.state], states) if ex.state is not None \
        else None
    fed_rows = None
    if fed_to:
        assert feed is not None         # fed_to is filled from it
        fed_rows = FedFromDevice(staged[-2], staged[-1], feed[0])
    lora_round = LoraInputs(make_lora_round(ex.model.lora, segments, staged[3 + 2 * n:]),
                            needs) if segments is not None else None
    return StagedRound(ids_t, rows_t, metas, states_b, fed_rows, lora_round), rows, spec_round


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
