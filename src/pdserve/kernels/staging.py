"""Host lists to device tensors in one copy.

A round's small host-made tensors (token ids, positions, slots, sampling
parameters) each cost a blocking copy when built with
`torch.tensor(list, device="cuda")`: torch copies pageable memory and then
synchronizes the stream, so the host waits for every kernel already queued.
Packed into one host tensor, pinned, and copied with `non_blocking=True`,
they cost one asynchronous copy that queues behind the GPU's work instead.
torch's pinned host allocator records the copy's stream use, so a staging
block is not handed out again before its copy has run. On CPU nothing is
copied at all.
"""

from __future__ import annotations

import torch


def stage(values, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """`values` (a list, or a host tensor) as one tensor on `device`."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def stage_rows(rows: list[list], device: torch.device, dtype=torch.long) -> list[torch.Tensor]:
    """Several host lists in one copy: a view on `device` for each list."""
    flat = [v for row in rows for v in row]
    dev = stage(flat, device, dtype)
    out, at = [], 0
    for row in rows:
        out.append(dev[at:at + len(row)])
        at += len(row)
    return out
