"""The fused batched LoRA on CUDA: a segmented gather-and-matmul in Triton
(as punica's SGMV and vLLM's Triton LoRA kernels), and the choice of
kernel for a device.

A round's rows are grouped by LoRA slot on the host (`LoraSegments`, the
torch path's plan): `rows` lists every row under an adapter, slot by slot;
segment i is `rows[starts[i]:starts[i] + lens[i]]`, all under `slots[i]`;
base rows are in none. Per fused matmul two kernels run, each over a grid
of (row tile x column tile, segment):

- the shrink: each segment's rows of x (gathered by index, never copied)
  times its slot's A stack, [in, modules * max_rank], into a float32
  buffer [rows, modules * max_rank];
- the expand, once per projection of the fused matmul: the projection's
  rank columns of that buffer times its B stack, [max_rank, out], added in
  place into the projection's columns of the fused output y. Every row is
  in one segment, so no two programs write one element: no atomics.

A row tile past its segment's end returns at once, so a grid sized by the
longest segment costs the short ones nothing but a launch slot. The
accumulation is float32; float32 inputs multiply at IEEE precision (not
TF32), so a float32 model's logits equal the merged weights' to 1e-5 as the
torch path's do.

Triton is optional (`pip install 'pdserve[gpu]'`): `lora_round` takes this
kernel on a CUDA device when triton imports, the torch segmented path
(`kernels/lora/batched.py`) everywhere else. Triton's interpreter
(`TRITON_INTERPRET=1`) runs the same kernels on CPU tensors; the tests
check them that way on a host without a GPU. The kernels themselves are
`kernels/lora/triton_kernels.py`, imported only when a fused round is made.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from functools import lru_cache

import torch

from pdserve.kernels.lora.batched import BatchedLora, LoraRound, LoraSegments, LoraStacks
from pdserve.kernels.staging import stage_rows

BLOCK_M = 16                   # rows a program takes of its segment (tl.dot's least)
BLOCK_K = 64                   # input columns a shrink step reads


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether triton is installed (found, not imported: a CPU engine never
    imports it)."""
    return importlib.util.find_spec("triton") is not None


def lora_round(stacks: LoraStacks, segments: LoraSegments,
               staged: Sequence[torch.Tensor] | None = None) -> BatchedLora:
    """The round a forward on `stacks`' device runs: the fused Triton
    kernels on CUDA when triton is installed, else the torch segmented path
    (`staged`: its lists already on the device, see `LoraRound`)."""
    if stacks.A[0][0].device.type == "cuda" and triton_available():
        return FusedLoraRound(stacks, segments)
    return LoraRound(stacks, segments, staged)


def segment_table(seg: LoraSegments) -> tuple[list[int], list[int], list[int], list[int]]:
    """(rows, starts, lens, slots) of every group in `seg`, batched or
    alone, slot by slot: the fused kernels' segments."""
    groups: dict[int, list[int]] = {s: [] for s in seg.slots}
    for src, dst in zip(seg.src, seg.dst):
        groups[seg.slots[dst // seg.width]].append(src)
    for slot, rows in seg.alone:
        groups[slot] = list(rows)
    rows_out: list[int] = []
    starts, lens, slots = [], [], []
    for slot in sorted(groups):
        starts.append(len(rows_out))
        lens.append(len(groups[slot]))
        slots.append(slot)
        rows_out.extend(groups[slot])
    return rows_out, starts, lens, slots


class FusedLoraRound:
    """One forward's LoRA under the fused Triton kernels (CUDA, or CPU
    tensors under `TRITON_INTERPRET=1`)."""

    def __init__(self, stacks: LoraStacks, segments: LoraSegments):
        if not triton_available():
            raise RuntimeError("the fused LoRA kernels need triton: pip install 'pdserve[gpu]' "
                               "(or use LoraRound, the torch path)")
        self.stacks, self.seg = stacks, segments
        self.active = segments.active
        if any(not 0 <= s < stacks.slots for s in self.active):
            raise IndexError(f"LoRA slots {self.active} outside [0, {stacks.slots})")
        rows, starts, lens, slots = segment_table(segments)
        self.segments = len(slots)
        self.max_len = max(lens, default=0)
        # one asynchronous copy of the four lists (kernels/staging.py)
        self._rows, self._starts, self._lens, self._slots = stage_rows(
            [rows, starts, lens, slots], stacks.A[0][0].device)
        from pdserve.kernels.lora.triton_kernels import kernels
        self._shrink, self._expand = kernels(os.environ.get("TRITON_INTERPRET", "0") == "1")

    @classmethod
    def of(cls, stacks: LoraStacks, row_slots: Sequence[int]) -> FusedLoraRound:
        """The round for rows whose slots are `row_slots` (-1: base)."""
        return cls(stacks, LoraSegments.of(row_slots))

    def add(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add to `y`, the output of fused matmul `group` of `layer` on rows
        `x`, what each row's adapter adds; in place, and returns `y`."""
        if not self.active:
            raise ValueError("a LoRA round with no active slot adds nothing; pass lora=None")
        A, Bs = self.stacks.A[layer][group], self.stacks.B[layer][group]
        R = self.stacks.max_rank
        if x.stride(-1) != 1:
            x = x.contiguous()
        if y.stride(-1) != 1:
            raise ValueError("the fused LoRA adds into y in place; y's last dimension must be "
                             f"contiguous (strides {tuple(y.stride())})")
        width = A.shape[2]                                  # modules * max_rank
        shrink = torch.empty(x.shape[0], width, dtype=torch.float32, device=x.device)
        fp32 = A.dtype == torch.float32
        tiles_m = -(-self.max_len // BLOCK_M)
        bn = min(64, _tile(width))
        self._shrink[(tiles_m * -(-width // bn), self.segments)](
            x, A, shrink, self._rows, self._starts, self._lens, self._slots,
            A.shape[1], width, x.stride(0), A.stride(0), A.stride(1), shrink.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K, FP32=fp32)
        col = 0
        for j, B in enumerate(Bs):
            out = B.shape[2]
            bn = min(128, _tile(out))
            self._expand[(tiles_m * -(-out // bn), self.segments)](
                shrink, B, y, self._rows, self._starts, self._lens, self._slots,
                out, R, j * R, col, shrink.stride(0), B.stride(0), B.stride(1), y.stride(0),
                BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_R=_tile(R), FP32=fp32)
            col += out
        return y


def _tile(n: int) -> int:
    """A tile side covering n: the next power of two (tl.arange's sizes),
    at least 16 (tl.dot's least). The expand's rank tile is all of the
    rank (it does not loop over it); the column tiles are capped."""
    return max(16, 1 << (n - 1).bit_length())
