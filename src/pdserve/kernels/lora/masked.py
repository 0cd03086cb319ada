"""The first batched LoRA, kept for `pdserve bench lora --kernel masked`:
every row's shrink under every adapter the round uses, a mask keeping the
row's own. Its cost grows with rows x adapters, which is why the segmented
round (`kernels/lora/batched.py`) replaced it; the bench compares the two.

x @ A_active gives every row its shrink under every active adapter, the
mask keeps the row's own, and each projection's @ B_active expands its
part. A gather of the active slots' stacks comes first unless every slot
is active.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.kernels.lora.batched import LoraStacks


class MaskedLoraRound:
    """One forward's rows (each row's slot, -1: base) under the masked kernel."""

    def __init__(self, stacks: LoraStacks, row_slots: Sequence[int]):
        self.stacks = stacks
        self.active = sorted({s for s in row_slots if s >= 0})
        if any(not 0 <= s < stacks.slots for s in self.active):
            raise IndexError(f"LoRA slots {self.active} outside [0, {stacks.slots})")
        self._all = self.active == list(range(stacks.slots))
        dev, dtype = stacks.A[0][0].device, stacks.A[0][0].dtype
        self._index = torch.tensor(self.active, device=dev, dtype=torch.long)
        slots = torch.tensor(list(row_slots), device=dev, dtype=torch.long)
        # [rows, active]: 1 where the row's adapter is that active slot
        self._mask = (slots.view(-1, 1) == self._index.view(1, -1)).to(dtype)
        # gate and up's B stacks are views of one joint stack (LoraStacks.B_joint);
        # this kernel reads each as one [slots * rank, out] matrix, so with every
        # slot active it takes contiguous copies once, not one per forward
        self._B = [[[B if B.is_contiguous() or not self._all else B.contiguous() for B in Bs]
                    for Bs in layer] for layer in stacks.B]

    def add(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` plus what the round's adapters add to fused matmul `group`."""
        A, Bs = self.stacks.A[layer][group], self._B[layer][group]
        if not self._all:
            A = A.index_select(0, self._index)
            Bs = [B.index_select(0, self._index) for B in Bs]
        n, m, R = len(self.active), len(Bs), self.stacks.max_rank
        rows = x.shape[0]
        shrink = torch.matmul(x, A).transpose(0, 1).reshape(rows, n, m, R)  # [rows, n, m, R]
        shrink = (shrink * self._mask.view(rows, n, 1, 1)).contiguous()
        if m == 1:
            return y + shrink.view(rows, n * R) @ Bs[0].reshape(n * R, -1)
        return y + torch.cat([shrink[:, :, j].reshape(rows, n * R) @ B.reshape(n * R, -1)
                              for j, B in enumerate(Bs)], dim=1)
