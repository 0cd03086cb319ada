"""An engine's LoRA adapters: which loads it holds, and the device slot of each.

The router names a request's adapter by name and load id (scheduler/
adapters.py); an engine serves it only if it holds that very load, so a
request never runs under other weights than the ones its id stands for:
not on a D whose P computed its KV, not after a reload under the same name.
Each adapter is read from its PEFT directory into host memory, where at
most `max_cpu_loras` stay (engine/lora/host.py: an LRU, re-read on
demand); the planner assigns device slots (scheduler/lora/slots.py),
and the executor copies an adapter into its slot when a round first needs
it there. A pinned adapter stays in host memory and, once in a slot, keeps
it.
"""

from __future__ import annotations

import threading

from pdserve.kernels.lora.adapter import LoraAdapter, load_adapter
from pdserve.engine.lora.host import AdapterChanged, HostAdapters, fingerprint
from pdserve.scheduler.lora.slots import AdapterSlots
from pdserve.scheduler.lora.adapters import BASE, AdapterRef, AdapterRegistry
from pdserve.scheduler.planner import RejectedRequest


class AdapterMissing(RejectedRequest):
    """A request under an adapter load this engine does not hold."""


class EngineAdapters:
    def __init__(self, model, engine: str, adapters, max_loras: int, max_rank: int,
                 base_name: str = "", max_cpu_loras: int | None = None,
                 pinned: tuple[str, ...] = ()):
        """`adapters`: (name, PEFT directory) pairs, given ids 1.. in order, as
        every engine and router of the deployment gives them; `pinned`: the
        names among them to pin. `max_cpu_loras`: adapters kept in host
        memory (None: max_loras)."""
        if not hasattr(model, "enable_lora"):
            raise ValueError(f"{type(model).__name__} does not apply LoRA adapters")
        self.engine = engine
        self.registry = AdapterRegistry(base_name)
        self.max_rank = max_rank
        self.stacks = model.enable_lora(max_loras, max_rank)
        self._model_cfg = model.cfg
        self.host = HostAdapters(max_cpu_loras or max_loras, self.read)
        # the planner's slots (`bind`), told of pins; until bound, pins wait here
        self._slots: AdapterSlots | None = None
        self._pins: set[int] = set()
        self._in_slot = [BASE] * max_loras            # the load each device slot has now
        self.loads = 0                                # copies into a slot so far
        # loads no longer registered whose weights live requests may still
        # read: load id -> set once none is left (unload's answer waits on it)
        self.unloading: dict[int, threading.Event] = {}
        for name, path in adapters:
            self.load(name, path, pinned=name in pinned)

    def bind(self, slots: AdapterSlots) -> None:
        """The planner's slots, which keep a pinned load's slot for it."""
        self._slots = slots
        for adapter_id in self._pins:
            slots.pin(adapter_id)

    def read(self, path: str) -> LoraAdapter:
        """An adapter's weights from its PEFT directory (off the loop thread)."""
        return load_adapter(path, self._model_cfg, self.max_rank)

    def load(self, name: str, path: str, id: int | None = None,
             weights: LoraAdapter | None = None, pinned: bool = False,
             stamp: tuple | None = None) -> AdapterRef:
        """Register `path` under `name` (a new id, or `id` the router issued);
        a load already under `name` stops taking requests and is unloaded
        once its last one ends. `weights` read off the loop, with `stamp`
        its files' fingerprint taken before the read."""
        if self.holds(name, id):
            return self.registry.get(name)          # type: ignore[return-value]
        if weights is None:
            stamp = fingerprint(path)
            weights = self.read(path)
        if pinned:
            self._check_pin(name)
        old = self.registry.get(name)
        ref = self.registry.load(name, path, id)
        self.host.add(ref.id, path, weights, pinned, stamp)
        if pinned:
            self._pins.add(ref.id)
            if self._slots is not None:
                self._slots.pin(ref.id)
        if old is not None:
            self._unpin(old.id)
            self.unloading[old.id] = threading.Event()
        return ref

    def holds(self, name: str, id: int | None) -> bool:
        """Whether `name` is load `id` here already (a load sent twice, as
        the router's replay may, is done once)."""
        ref = self.registry.get(name)
        return id is not None and ref is not None and ref.id == id

    def _check_pin(self, name: str) -> None:
        """Refuse a pin that would leave no slot for the unpinned adapters
        before anything is registered."""
        old = self.registry.get(name)
        pins = len(self._pins) - (old is not None and old.id in self._pins)
        if pins + 1 >= self.stacks.slots:
            raise ValueError(f"cannot pin LoRA adapter {name!r}: {pins} of lora.max_loras="
                             f"{self.stacks.slots} device slots are pinned and one must stay "
                             "free for the unpinned adapters; raise max_loras or unpin one")

    def _unpin(self, adapter_id: int) -> None:
        self._pins.discard(adapter_id)
        if self._slots is not None:
            self._slots.unpin(adapter_id)

    def unload(self, name: str, adapter_id: int) -> threading.Event:
        """Take no new request under `name`'s load `adapter_id`; the event is
        set once no live request under it is left (`reap`)."""
        ref = self.registry.get(name)
        if ref is None or ref.id != adapter_id:
            done = self.unloading.get(adapter_id)
            if done is not None:
                return done                           # an unload already under way
            raise KeyError(f"{self.engine} holds no LoRA adapter {name!r} (load {adapter_id})")
        self.registry.unload(name)
        self._unpin(adapter_id)
        done = self.unloading[adapter_id] = threading.Event()
        return done

    def reap(self, live: set, slots) -> None:
        """Free the unloaded loads no live request (ids in `live`) runs under;
        `slots`: the planner's AdapterSlots, whose slot they held is empty again."""
        for adapter_id, done in list(self.unloading.items()):
            if adapter_id not in live:
                del self.unloading[adapter_id]
                self.host.drop(adapter_id)
                slots.forget(adapter_id)
                done.set()

    def ensure(self, slot: int, adapter_id: int) -> None:
        """Slot `slot` holds load `adapter_id` before a forward reads it. The
        planner hands a slot to another load only when nothing references
        it (quiescent), so this never overwrites weights a forward reads."""
        if self._in_slot[slot] != adapter_id:
            self.stacks.load(slot, self.host.get(adapter_id))
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
        try:
            self.host.prefetch(adapter_id)          # evicted: re-read before its round
        except AdapterChanged as e:
            raise AdapterMissing(f"{self.engine}: {e}") from None
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


def adapters_in_use(adapters: EngineAdapters | None, planner) -> tuple[list[str], list[str]]:
    """The adapters the planner's requests run under, by name, sorted: those
    of requests running (prefilling, decoding, landing, transferring) and
    those of requests waiting or retracted. vLLM's `lora_requests_info`."""
    if adapters is None:
        return [], []
    p = planner
    live = (*p.prefilling.values(), *p.running.values(), *p.landing.values(),
            *p.transferring.values())
    running = {name_of(adapters, r.adapter) for r in live if r.adapter != BASE}
    waiting = {name_of(adapters, r.adapter) for r in (*p.waiting, *p.retracted.values())
               if r.adapter != BASE}
    return sorted(running - {""}), sorted(waiting - {""})
