"""LoRA adapters in the simulator: a trace's `adapter` names become load
ids, the engines' planners get `lora.max_loras` slots (so a request waits
for a slot and the slots rotate only when quiescent, as served), and a
round costs what its adapters add.

The cost, per round: each distinct adapter's weights read once (the
segmented kernel reads each active adapter's A and B once; its FLOPs are
small beside the base's), and each slot that changes adapter copies one
adapter over the host link. An adapter's size comes from the model preset
and `lora.max_lora_rank` (rank r on q, k, v, o, gate, up and down: r x
(in + out) weights each, at the preset's dtype); the intermediate width
is what the preset's parameter count leaves after attention.
"""

from __future__ import annotations

from pdserve.scheduler.lora.adapters import BASE, AdapterRegistry


class TraceAdapters:
    """Names to load ids for one simulation: the config's adapters (ids
    1.. in config order, as served), else every name the trace uses, in
    first-seen order."""

    def __init__(self, configured: dict, names: list[str]):
        self.fixed = bool(configured)
        self.registry = AdapterRegistry.from_config(configured) if configured \
            else AdapterRegistry()
        if not self.fixed:
            for n in names:
                if self.registry.get(n) is None:
                    self.registry.load(n, "")

    @property
    def used(self) -> bool:
        return len(self.registry) > 0

    def resolve(self, name: str | None) -> int:
        """The load id a trace request's adapter names (BASE for none);
        KeyError naming what is served when the config lists adapters."""
        return self.registry.resolve(name or "")


def adapter_bytes(model, rank: int) -> float:
    """One rank-`rank` adapter on every layer's seven projections."""
    h = model.q_heads * model.head_dim
    kv = model.kv_heads * model.head_dim
    attn = 2 * h * h + 2 * h * kv                       # q, o; k, v
    inter = max((model.compute_params / model.layers - attn) / (3 * h), h)
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + 3 * (h + inter)   # q k v o gate up down
    return rank * per_layer * model.layers * model.dtype_bytes


class SimLora:
    """One engine's LoRA cost: the slot contents, and a round's extra seconds."""

    def __init__(self, cost, slots: int, rank: int):
        self.cost = cost
        self.bytes = adapter_bytes(cost.model, rank)
        self._in_slot = [BASE] * slots
        self.slot_loads = 0

    def round_seconds(self, plan) -> float:
        active: dict[int, int] = {}
        for op in plan.prefills:
            if op.req.adapter:
                active[op.req.lora_slot] = op.req.adapter
        for req in plan.decodes:
            if req.adapter:
                active[req.lora_slot] = req.adapter
        if not active:
            return 0.0
        loads = 0
        for slot, adapter in active.items():
            if self._in_slot[slot] != adapter:
                self._in_slot[slot] = adapter
                loads += 1
        self.slot_loads += loads
        gpu = self.cost.gpu
        return len(active) * self.bytes / (gpu.mem_bw * gpu.mbu) + loads * self.bytes / gpu.pcie_bw
