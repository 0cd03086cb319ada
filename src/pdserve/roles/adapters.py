"""An engine's LoRA adapters: which loads it holds, and the device slot of each.

The router names a request's adapter by name and load id (scheduler/
adapters.py); an engine serves it only if it holds that very load, so a
request never runs under other weights than the ones its id stands for:
not on a D whose P computed its KV, not after a reload under the same name.
Each adapter is read once from its PEFT directory into host memory and
copied into a slot of the model's LoRA stacks; this version keeps every
adapter it holds in a slot.
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
        self._slot: dict[int, int] = {}               # load id -> device slot
        for name, path in adapters:
            self.load(name, path)

    def load(self, name: str, path: str, id: int | None = None) -> AdapterRef:
        """Read `path`, register it under `name` (a new id) and put it in a slot."""
        weights = load_adapter(path, self._model_cfg, self.max_rank)
        free = sorted(set(range(self.stacks.slots)) - set(self._slot.values()))
        old = self.registry.get(name)
        if not free and old is None:
            raise RejectedRequest(f"{self.engine} holds {len(self._slot)} adapters in its "
                                  f"{self.stacks.slots} slots (lora.max_loras); unload one "
                                  f"or raise max_loras")
        ref = self.registry.load(name, path, id)
        slot = self._slot.pop(old.id) if old is not None else free[0]
        if old is not None:
            del self.weights[old.id]
        self.stacks.load(slot, weights)
        self.weights[ref.id] = weights
        self._slot[ref.id] = slot
        return ref

    def slot(self, adapter_id: int) -> int:
        """The device slot of a held load (-1: the base model)."""
        return -1 if adapter_id == BASE else self._slot[adapter_id]

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
