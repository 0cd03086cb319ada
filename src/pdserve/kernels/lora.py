"""Batched LoRA: many adapters in one forward, each row under its own.

`LoraStacks` holds `max_loras` device slots. Per layer, the projections
that share one fused matmul in the decoder (q k v; o; gate up; down) share
one A stack, [slots, modules * max_rank, in] (they read the same input), and
each projection has its B stack, [out, slots, max_rank], already scaled.
Ranks below max_rank are zero-padded, an untargeted module is zeros.

`LoraRound` is one forward's view: each row's slot (-1: the base model) and
the round's distinct slots. A fused matmul's delta is a gather of the
active slots' stacks (none when every slot is active) and dense matmuls
with a mask between them: x @ A_active^T gives every row its shrink under
every active adapter, the mask keeps the row's own, and each projection's
@ B_active^T expands its part.
The cost grows with the adapters a round uses, not with the slots or the
rows per adapter, and a round of base rows only costs nothing.
"""

from __future__ import annotations

import torch

from pdserve.kernels.lora_adapter import LoraAdapter, module_shape
from pdserve.kernels.model_config import ModelConfig

# the decoder's fused matmuls, each the projections it concatenates, in order
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
QKV, O, GATE_UP, DOWN = range(4)


class LoraStacks:
    """`slots` adapters' weights on the device, loaded and cleared by slot."""

    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, dtype, device):
        if slots < 1 or max_rank < 1:
            raise ValueError(f"LoRA stacks need slots >= 1 and max_rank >= 1 "
                             f"(got {slots} and {max_rank})")
        self.cfg, self.slots, self.max_rank = cfg, slots, max_rank
        self.A: list[list[torch.Tensor]] = []
        self.B: list[list[list[torch.Tensor]]] = []     # layer, group, module
        # (group, index in the group) of each module
        self._where = {m: (g, j) for g, mods in enumerate(GROUPS) for j, m in enumerate(mods)}
        for _ in range(cfg.num_layers):
            a_row, b_row = [], []
            for mods in GROUPS:
                inp = module_shape(cfg, mods[0])[1]
                a_row.append(torch.zeros(slots, len(mods) * max_rank, inp, dtype=dtype,
                                         device=device))
                b_row.append([torch.zeros(module_shape(cfg, m)[0], slots, max_rank, dtype=dtype,
                                          device=device) for m in mods])
            self.A.append(a_row)
            self.B.append(b_row)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot`, replacing whatever was there."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.path!r} has rank {adapter.rank}, above the "
                             f"stacks' max_rank {self.max_rank}")
        self.clear(slot)
        R = self.max_rank
        for (layer, module), (a, b) in adapter.weights.items():
            g, j = self._where[module]
            r = a.shape[0]
            self.A[layer][g][slot, j * R:j * R + r].copy_(a)
            self.B[layer][g][j][:, slot, :r].copy_(b)

    def clear(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"LoRA slot {slot} outside [0, {self.slots})")
        for a_row, b_row in zip(self.A, self.B):
            for A, Bs in zip(a_row, b_row):
                A[slot].zero_()
                for B in Bs:
                    B[:, slot].zero_()


class LoraRound:
    """One forward's rows and their slots. `row_slots`: a device tensor of
    each row's slot (-1: base); `active`: the distinct slots it holds, from
    the host (so nothing here waits on the device)."""

    def __init__(self, stacks: LoraStacks, row_slots: torch.Tensor, active: list[int],
                 index: torch.Tensor | None = None):
        """`index`: `active` already on the device (sorted, distinct), as
        the executor stages it with the round's other lists."""
        self.stacks = stacks
        self.active = sorted(set(active))
        if any(not 0 <= s < stacks.slots for s in self.active):
            raise IndexError(f"LoRA slots {self.active} outside [0, {stacks.slots})")
        self._all = self.active == list(range(stacks.slots))
        dev = stacks.A[0][0].device
        self._index = index if index is not None else \
            torch.tensor(self.active, device=dev, dtype=torch.long)
        act = self._index.to(row_slots.device)
        dtype = stacks.A[0][0].dtype
        # [rows, active]: 1 where the row's adapter is that active slot
        self._mask = (row_slots.view(-1, 1) == act.view(1, -1)).to(dtype)

    def delta(self, layer: int, group: int, x: torch.Tensor) -> torch.Tensor:
        """What the round's adapters add to fused matmul `group` of `layer`
        for rows `x` (a forward skips a round without active slots)."""
        if not self.active:
            raise ValueError("a LoRA round with no active slot adds nothing; pass lora=None")
        A, Bs = self.stacks.A[layer][group], self.stacks.B[layer][group]
        if not self._all:
            A = A.index_select(0, self._index)
            Bs = [B.index_select(1, self._index) for B in Bs]
        n, m, R = len(self.active), len(Bs), self.stacks.max_rank
        rows = x.shape[0]
        shrink = x @ A.reshape(n * m * R, -1).t()                       # [rows, n * m * R]
        shrink = shrink.view(rows, n, m, R) * self._mask.view(rows, n, 1, 1)
        if m == 1:
            return shrink.view(rows, n * R) @ Bs[0].reshape(-1, n * R).t()
        return torch.cat([shrink[:, :, j].reshape(rows, n * R) @ B.reshape(-1, n * R).t()
                          for j, B in enumerate(Bs)], dim=1)
