"""Batched LoRA: many adapters in one forward, each row under its own.

`LoraStacks` holds `max_loras` device slots. Per layer, the projections
that share one fused matmul in the decoder (q k v; o; gate up; down) share
one A stack, [slots, in, modules * max_rank] (they read the same input),
and each projection has its B stack, [slots, max_rank, out], already scaled.
Both are the right-hand operand of their matmul as stored (x @ A[slot],
shrink @ B[slot]): one slot's shrink and expand each read one contiguous
block, and on a CPU a batched matmul of one row per slot reads A stored
so about twice as fast as A stored [out, in] and read transposed.
Projections of one width in one group (gate up) have their B stacks as
views of one [slots, modules, max_rank, out] stack (`B_joint`).
Ranks below max_rank are zero-padded, an untargeted module is zeros.

`LoraSegments` plans a round's rows on the host: grouped by slot, base rows
in none. Short groups (decode rows, a few per adapter) are padded to one
width and run as one batched matmul: a gather of their rows into
[segments, width, in], a bmm with their A stacks (the shrink), a bmm per
projection with their B stacks (the expand), and an index_add back into
the rows (or, when the batch is the rows in order, the expands added into
y in place; gate and up's as one matmul). A group much longer than the
others (a prefill chunk) runs alone as plain matmuls on its rows, so
padding never costs more than twice the rows it pads. `LoraRound` is that
plan on the device for one forward: the CPU's path (on CUDA,
`fused.py`'s Triton kernels).
The cost grows with the rows under an adapter, not with rows x adapters (the
masked kernel it replaced, kept in `masked.py` for the bench), and a
round of base rows only costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kernels.lora.adapter import LoraAdapter, module_shape
from pdserve.kernels.models.model_config import ModelConfig

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
        # a group whose projections have one width (gate up): its B stacks
        # are views of one [slots, modules, max_rank, out], so one matmul
        # of slots x modules batches expands them all
        self.B_joint: list[list[torch.Tensor | None]] = []
        # (group, index in the group) of each module
        self._where = {m: (g, j) for g, mods in enumerate(GROUPS) for j, m in enumerate(mods)}
        for _ in range(cfg.num_layers):
            a_row, b_row, joint_row = [], [], []
            for mods in GROUPS:
                inp = module_shape(cfg, mods[0])[1]
                a_row.append(torch.zeros(slots, inp, len(mods) * max_rank, dtype=dtype,
                                         device=device))
                outs = [module_shape(cfg, m)[0] for m in mods]
                joint = torch.zeros(slots, len(mods), max_rank, outs[0], dtype=dtype,
                                    device=device) if len(mods) > 1 and len(set(outs)) == 1 \
                    else None
                joint_row.append(joint)
                b_row.append([joint[:, j] for j in range(len(mods))] if joint is not None else
                             [torch.zeros(slots, max_rank, out, dtype=dtype, device=device)
                              for out in outs])
            self.A.append(a_row)
            self.B.append(b_row)
            self.B_joint.append(joint_row)

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
            self.A[layer][g][slot, :, j * R:j * R + r].copy_(a.t())
            self.B[layer][g][j][slot, :r].copy_(b.t())

    def clear(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"LoRA slot {slot} outside [0, {self.slots})")
        for a_row, b_row in zip(self.A, self.B):
            for A, Bs in zip(a_row, b_row):
                A[slot].zero_()
                for B in Bs:
                    B[slot].zero_()


class BatchedLora(Protocol):
    """What a forward needs of a round's LoRA: the slots it uses, and the
    delta of each fused matmul added to its output."""
    active: list[int]

    def add(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class LoraSegments:
    """A round's rows grouped by LoRA slot, planned on the host. The
    batched segments are padded to `width` rows each; `src[i]` is a row
    that goes to position `dst[i]` (segment * width + offset) of the padded
    batch. `alone`: groups run as their own matmuls, (slot, rows)."""
    rows: int
    slots: tuple[int, ...]
    width: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    alone: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def active(self) -> list[int]:
        """Every slot the round uses, sorted."""
        return sorted([*self.slots, *(s for s, _ in self.alone)])

    @property
    def padded(self) -> bool:
        return len(self.slots) * self.width != len(self.src)

    @classmethod
    def of(cls, row_slots: Sequence[int]) -> LoraSegments:
        """Group `row_slots` (each row's slot, -1: base). The batched groups
        are the shortest ones, as many as keep the padded batch within
        twice their rows; the longer ones run alone. One group runs alone."""
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        order = sorted(groups, key=lambda s: (len(groups[s]), s))
        take, total = 0, 0
        for k, slot in enumerate(order):
            total += len(groups[slot])
            if (k + 1) * len(groups[slot]) > 2 * total:
                break
            take = k + 1
        if take == 1:
            take = 0
        batched = sorted(order[:take])
        width = max((len(groups[s]) for s in batched), default=0)
        src: list[int] = []
        dst: list[int] = []
        for k, slot in enumerate(batched):
            src.extend(groups[slot])
            dst.extend(range(k * width, k * width + len(groups[slot])))
        alone = tuple((s, tuple(groups[s])) for s in sorted(order[take:]))
        return cls(len(row_slots), tuple(batched), width, tuple(src), tuple(dst), alone)

    def lists(self) -> list[list[int]]:
        """The host lists a round stages on the device, in `LoraRound`'s order."""
        return [list(self.slots), list(self.src), list(self.dst),
                *(list(rows) for _, rows in self.alone)]


class LoraRound:
    """One forward's LoRA: `segments` on the device. `staged`: its
    `lists()` already on the device (the executor stages them with the
    round's other lists, in one copy); otherwise they are copied here."""

    def __init__(self, stacks: LoraStacks, segments: LoraSegments,
                 staged: Sequence[torch.Tensor] | None = None):
        self.stacks, self.seg = stacks, segments
        self.active = segments.active
        if any(not 0 <= s < stacks.slots for s in self.active):
            raise IndexError(f"LoRA slots {self.active} outside [0, {stacks.slots})")
        dev = stacks.A[0][0].device
        if staged is None:
            staged = [torch.tensor(v, device=dev, dtype=torch.long) for v in segments.lists()]
        self._slots, self._src, self._dst = (t.to(dev) for t in staged[:3])
        # consecutive slots: the stacks' slice is a view, no gather
        sl = segments.slots
        self._range = slice(sl[0], sl[-1] + 1) if sl and sl[-1] - sl[0] + 1 == len(sl) else None
        # src in row order with no padding: the batch is x itself
        self._identity = not segments.padded and list(segments.src) == list(range(segments.rows))
        # a group's rows, as a slice when they are contiguous (a prefill chunk)
        self._alone: list[tuple[int, slice | torch.Tensor]] = []
        for (slot, rows), t in zip(segments.alone, staged[3:]):
            if rows[-1] - rows[0] + 1 == len(rows):
                self._alone.append((slot, slice(rows[0], rows[-1] + 1)))
            else:
                self._alone.append((slot, t.to(dev)))

    @classmethod
    def of(cls, stacks: LoraStacks, row_slots: Sequence[int]) -> LoraRound:
        """The round for rows whose slots are `row_slots` (-1: base)."""
        return cls(stacks, LoraSegments.of(row_slots))

    def add(self, layer: int, group: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add to `y`, the output of fused matmul `group` of `layer` on rows
        `x`, what each row's adapter adds; in place, and returns `y`."""
        if not self.active:
            raise ValueError("a LoRA round with no active slot adds nothing; pass lora=None")
        A, Bs = self.stacks.A[layer][group], self.stacks.B[layer][group]
        R = self.stacks.max_rank
        if self.seg.slots:
            self._batched(A, Bs, self.stacks.B_joint[layer][group], R, x, y)
        for slot, rows in self._alone:
            if isinstance(rows, slice):     # each projection's expand added in place
                shrink = x[rows] @ A[slot]                              # [k, m * R]
                col = 0
                for j, B in enumerate(Bs):
                    out = B.shape[2]
                    y[rows, col:col + out].addmm_(shrink[:, j * R:(j + 1) * R], B[slot])
                    col += out
                continue
            shrink = x.index_select(0, rows) @ A[slot]
            d = torch.cat([shrink[:, j * R:(j + 1) * R] @ B[slot]
                           for j, B in enumerate(Bs)], dim=1) if len(Bs) > 1 \
                else shrink @ Bs[0][slot]
            y.index_add_(0, rows, d)
        return y

    def _batched(self, A, Bs, joint, R: int, x: torch.Tensor, y: torch.Tensor) -> None:
        seg = self.seg
        n, w = len(seg.slots), seg.width
        # one row a slot, y's rows in order, and one B for the group's projections
        joint = joint if joint is not None and w == 1 and self._identity and \
            y.is_contiguous() else None
        if self._range is not None:
            A, Bs = A[self._range], [B[self._range] for B in Bs]
            joint = joint[self._range] if joint is not None else None
        else:
            A = A.index_select(0, self._slots)
            if joint is not None:
                joint = joint.index_select(0, self._slots)
            else:
                Bs = [B.index_select(0, self._slots) for B in Bs]
        if self._identity:
            xs = x
        elif not seg.padded:
            xs = x.index_select(0, self._src)
        else:
            xs = x.new_zeros(n * w, x.shape[1]).index_copy_(0, self._dst,
                                                            x.index_select(0, self._src))
        shrink = torch.bmm(xs.reshape(n, w, -1), A)                       # [n, w, m * R]
        if joint is not None:
            # [n * m, 1, R] @ [n * m, R, out] into y as [n * m, 1, out]: (row, projection)
            m, out = joint.shape[1], joint.shape[3]
            y.view(n * m, 1, out).baddbmm_(shrink.view(n * m, 1, R), joint.reshape(n * m, R, out))
            return
        if self._identity and y.is_contiguous():
            # the batch is y's rows: each projection's expand added in place
            y3, col = y.view(n, w, -1), 0
            for j, B in enumerate(Bs):
                out = B.shape[2]
                y3[:, :, col:col + out].baddbmm_(shrink[:, :, j * R:(j + 1) * R], B)
                col += out
            return
        parts = [torch.bmm(shrink[:, :, j * R:(j + 1) * R], B)
                 for j, B in enumerate(Bs)]                            # each [n, w, out_j]
        d = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).view(n * w, -1)
        if self._identity:
            y += d
        elif not seg.padded:
            y.index_add_(0, self._src, d)
        else:
            y.index_add_(0, self._src, d.index_select(0, self._dst))
