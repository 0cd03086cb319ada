"""An engine's LoRA adapters: which loads it holds, and the device slot of each.

The router names a request's adapter by name and load id (scheduler/
adapters.py); an engine serves it only if it holds that very load, so a
request never runs under other weights than the ones its id stands for:
not on a D whose P computed its KV, not after a reload under the same name.
Each adapter is read once from its PEFT directory into host memory; the
planner assigns device slots (scheduler/adapter_slots.py), and the executor
copies an adapter into its slot when a round first needs it there.
"""

from __future__ import annotations

from pdserve.kernels.lora_adapter import LoraAdapter, load_adapter
from pdserve.scheduler.adapters import BASE, AdapterRef, AdapterRegistry
from pdserve.scheduler.planner import RejectedRequest


class AdapterMissing(RejectedRequest):
    """A request under an adapter load this engine does not hold."""


class EngineAdapters:
    def __init__(self, model, engine: str, adapters, max_loras: int, max_rank: int,
                 base_name: str = ""):
        """`adapters`: (name, PEFT directory) pairs, given ids 1.. in order, as
        every engine and router of the deployment gives them."""
        if not hasattr(model, "enable_lora"):
            raise ValueError(f"{type(model).__name__} does not apply LoRA adapters")
        self.engine = engine
        self.registry = AdapterRegistry(base_name)
        self.max_rank = max_rank
        self.stacks = model.enable_lora(max_loras, max_rank)
        self._model_cfg = model.cfg
        self.weights: dict[int, LoraAdapter] = {}     # host copies, by load id
        self._in_slot = [BASE] * max_loras            # the load each device slot has now
        self.loads = 0                                # copies into a slot so far
        for name, path in adapters:
            self.load(name, path)

    def load(self, name: str, path: str, id: int | None = None) -> AdapterRef:
        """Read `path` and register it under `name` (a new id)."""
        weights = load_adapter(path, self._model_cfg, self.max_rank)
        ref = self.registry.load(name, path, id)
        self.weights[ref.id] = weights
        return ref

    def ensure(self, slot: int, adapter_id: int) -> None:
        """Slot `slot` holds load `adapter_id` before a forward reads it. The
        planner hands a slot to another load only when nothing references
        it (quiescent), so this never overwrites weights a forward reads."""
        if self._in_slot[slot] != adapter_id:
            self.stacks.load(slot, self.weights[adapter_id])
            self._in_slot[slot] = adapter_id
            self.loads += 1

    def check(self, name: str, adapter_id: int) -> int:
        """The load id a request names, if this engine holds that load; else
        AdapterMissing, saying what it holds."""
        if not name and adapter_id == BASE:
            return BASE
        ref = self.registry.by_id(adapter_id)
        if ref is None or ref.name != name:
            held = ", ".join(f"{r.name!r} (load {r.id})" for r in self.registry.refs()) \
                or "none"
            raise AdapterMissing(f"{self.engine} does not hold LoRA adapter {name!r} (load "
                                 f"{adapter_id}); it holds {held}: load it there, or route "
                                 "the request to an engine that does")
        return adapter_id

    def refs(self) -> list[AdapterRef]:
        return self.registry.refs()


def adapter_of(adapters: EngineAdapters | None, engine: str, name: str, adapter_id: int) -> int:
    """The load id a Submit or RemotePrefill names, checked against what
    `engine` holds (`adapters` None: it serves the base model only)."""
    if adapters is not None:
        return adapters.check(name, adapter_id)
    if name or adapter_id:
        raise AdapterMissing(f"{engine} serves no LoRA adapters, so not {name!r} (load "
                             f"{adapter_id}); route the request to an engine that holds it")
    return BASE


def name_of(adapters: EngineAdapters | None, adapter_id: int) -> str:
    """The name a held load goes by on the wire ("" for the base model)."""
    if adapter_id == BASE or adapters is None:
        return ""
    ref = adapters.registry.by_id(adapter_id)
    return ref.name if ref is not None else ""
