"""State slots: the per-sequence state of layers that keep a fixed-size
state instead of K/V (Qwen3.5's Gated DeltaNet), and what a round reads
and writes of it.

A slot is one sequence's state at one point of its history, for every state
layer: the last kernel - 1 inputs of each layer's causal conv, and each
layer's delta-rule matrix per value head. Unlike K/V it does not grow with
the sequence and cannot be cut back, so resuming at an earlier point means
restoring a slot written there (a checkpoint) and computing on from it. The
planner owns which slot holds what; a round names, per sequence, the slot it
starts from and the slots it leaves its state in (`StateBatch`).

Within a round every read sees the slots as they were before the round, and
every write lands after all reads: several sequences may start from one
checkpoint (a fork), and a sequence may write back the slot it read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels.kv_cache import _from_bytes, _to_bytes
from pdserve.kernels.models.model_config import ModelConfig


class StateCache:
    """Slot-major, like KVCache is page-major: `conv` [slots, layers,
    conv_dim, kernel - 1] in the model dtype and `recurrent` [slots, layers,
    heads, k_head_dim, v_head_dim] in float32, whatever the model dtype.
    float32 because transformers' reference keeps it so (its chunked delta
    rule computes and returns the state in float32, and its cache stores
    what it is given); a bfloat16 state would drift over a long decode. One
    slot is contiguous in each tensor: a restore, a fork or a transfer of a
    sequence's state is one copy per tensor."""

    def __init__(self, slots: int, layers: int, conv_shape: tuple, recurrent_shape: tuple,
                 dtype: torch.dtype, device, pin_memory: bool = False):
        self.conv = torch.zeros((slots, layers, *conv_shape), dtype=dtype, device=device,
                                pin_memory=pin_memory)
        self.recurrent = torch.zeros((slots, layers, *recurrent_shape), dtype=torch.float32,
                                     device=device, pin_memory=pin_memory)

    @classmethod
    def for_model(cls, cfg: ModelConfig, slots: int, dtype: torch.dtype, device,
                  pin_memory: bool = False) -> StateCache:
        """`slots` slots for every state layer of `cfg` (`cfg.state_layers()`)."""
        return cls(slots, len(cfg.state_layers()), cfg.conv_state_shape(),
                   cfg.recurrent_state_shape(), dtype, device, pin_memory)

    @property
    def slots(self) -> int:
        return self.conv.shape[0]

    @property
    def layers(self) -> int:
        return self.conv.shape[1]

    def slot_bytes(self) -> int:
        """One slot's bytes (= ModelConfig.state_slot_bytes of the model dtype)."""
        return (self.conv[0].numel() * self.conv.element_size()
                + self.recurrent[0].numel() * self.recurrent.element_size())

    def layout(self) -> str:
        """A slot's shapes, as the disk tier names them."""
        return ("state:" + "x".join(str(n) for n in self.conv.shape[1:]) + "+"
                + "x".join(str(n) for n in self.recurrent.shape[1:]))

    def read_slot(self, slot: int) -> bytes:
        """Slot `slot`'s bytes: its conv state, then its recurrent state."""
        return _to_bytes(self.conv[slot]) + _to_bytes(self.recurrent[slot])

    def write_slot(self, slot: int, data: bytes) -> None:
        """Slot `slot` = `data`, bytes `read_slot` gave for the same layout."""
        n = self.conv[slot].numel() * self.conv.element_size()
        _from_bytes(self.conv[slot], data[:n])
        _from_bytes(self.recurrent[slot], data[n:])

    def layer(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """State layer j's (conv [slots, conv_dim, kernel - 1], recurrent
        [slots, heads, k_head_dim, v_head_dim]): views, written through."""
        return self.conv[:, j], self.recurrent[:, j]

    def zero(self, slot: int) -> None:
        """The state before any token."""
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()

    def copy_slots_from(self, src: "StateCache", src_slots, dst_slots) -> None:
        """This cache's `dst_slots[i]` = `src`'s `src_slots[i]` (a host
        snapshot stored or loaded back); queued like KVCache.copy_pages_from."""
        s = torch.as_tensor(list(src_slots), device=src.conv.device)
        d = torch.as_tensor(list(dst_slots), device=self.conv.device)
        self.conv[d] = src.conv[s].to(self.conv.device, non_blocking=True)
        self.recurrent[d] = src.recurrent[s].to(self.recurrent.device, non_blocking=True)

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` becomes slot `src`: a checkpoint restored, or a fork."""
        if src != dst:
            self.conv[dst].copy_(self.conv[src])
            self.recurrent[dst].copy_(self.recurrent[src])


@dataclass
class SeqState:
    read_slot: int        # holds the state before the extent's first row; -1: zeros (position 0)
    write_slot: int       # gets the state after the extent's last row; may be read_slot
    # (rows, slot): also leave the state after the extent's first `rows` rows
    # in `slot`, an aligned checkpoint inside the extent (spec §1.2); one
    # forward materializes it beside the final state
    checkpoint: tuple[int, int] | None = None


@dataclass
class StateBatch:
    cache: StateCache
    seqs: list            # SeqState, one per BatchMeta sequence, in BatchMeta's order

    def check(self, metas: list) -> None:
        """Raise ValueError unless this batch fits the round's SeqMetas: a
        read slot exactly where the sequence has history before its extent,
        checkpoints inside their extents, slots in range, and no slot
        written twice (which of two writes won would be up to the kernel)."""
        if len(self.seqs) != len(metas):
            raise ValueError(f"{len(self.seqs)} sequence states for the round's "
                             f"{len(metas)} sequences")
        n = self.cache.slots
        targets = []
        for i, (m, s) in enumerate(zip(metas, self.seqs)):
            start = m.ctx_len - m.q_len
            if start and s.read_slot == -1:
                raise ValueError(f"sequence {i} continues at position {start} but starts from "
                                 "zeros (read_slot -1); read the slot holding its state there")
            if not start and s.read_slot != -1:
                raise ValueError(f"sequence {i} starts at position 0 but reads slot "
                                 f"{s.read_slot}; a fresh prompt's state is zeros (read_slot -1)")
            if not -1 <= s.read_slot < n or not 0 <= s.write_slot < n:
                raise ValueError(f"sequence {i}: slots {s.read_slot} -> {s.write_slot} "
                                 f"outside the state cache's {n}")
            targets.append(s.write_slot)
            if s.checkpoint is not None:
                rows, slot = s.checkpoint
                if not 0 < rows <= m.q_len or not 0 <= slot < n:
                    raise ValueError(f"sequence {i}: checkpoint {s.checkpoint} must be after "
                                     f"1 to {m.q_len} rows, into a slot below {n}")
                targets.append(slot)
        if len(set(targets)) != len(targets):
            raise ValueError(f"a round writes some state slot twice ({targets}); give every "
                             "final state and checkpoint its own slot")


class StateRound:
    """A StateBatch as index tensors, built once a round and shared by
    every state layer: what each layer gathers before its sequences run
    and where their states go after."""

    def __init__(self, states: StateBatch, metas: list):
        states.check(metas)
        dev = states.cache.conv.device
        self.cache = states.cache
        self._reads = torch.tensor([max(s.read_slot, 0) for s in states.seqs], device=dev)
        self._fresh = torch.tensor([s.read_slot == -1 for s in states.seqs], device=dev)
        self._writes = torch.tensor([s.write_slot for s in states.seqs], device=dev)
        marked = [(i, s.checkpoint) for i, s in enumerate(states.seqs) if s.checkpoint]
        # {sequence index: rows}, and the slots in that order
        self.checkpoint_rows = {i: c[0] for i, c in marked}
        self._checkpoint_slots = torch.tensor([c[1] for _, c in marked], dtype=torch.long,
                                              device=dev)

    def read(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """State layer j's (conv, recurrent) before each sequence's extent,
        [sequences, ...]: copies, zeros where a sequence starts fresh."""
        conv, rec = self.cache.layer(j)
        conv0 = conv.index_select(0, self._reads)
        rec0 = rec.index_select(0, self._reads)
        conv0.masked_fill_(self._fresh.view(-1, 1, 1), 0)
        rec0.masked_fill_(self._fresh.view(-1, 1, 1, 1), 0)
        return conv0, rec0

    def write(self, j: int, conv: torch.Tensor, rec: torch.Tensor,
              checkpoint_conv: list, checkpoint_rec: list) -> None:
        """Each sequence's final state (`conv`, `rec`: [sequences, ...]) and
        its checkpoints (lists, in sequence order) into their slots."""
        conv_all, rec_all = self.cache.layer(j)
        conv_all.index_copy_(0, self._writes, conv.to(conv_all.dtype))
        rec_all.index_copy_(0, self._writes, rec)
        if checkpoint_conv:
            conv_all.index_copy_(0, self._checkpoint_slots,
                                 torch.stack(checkpoint_conv).to(conv_all.dtype))
            rec_all.index_copy_(0, self._checkpoint_slots, torch.stack(checkpoint_rec))
