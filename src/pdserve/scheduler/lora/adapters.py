"""LoRA adapters by name: each load gets a new, never reused id.

A request names its adapter by the OpenAI `model` field; the planner sees
only the id (`Request.adapter`, 0 for the base model), which salts every
cache key. An id is issued once per load: unloading `A` and loading it again,
even from the same path, gives a new id, so nothing cached under the old
weights can serve the new ones. A deployment's configured adapters get ids
1, 2, ... in config order on every engine and router alike; a later load's
id comes from whoever loads it (the router) and is given to each engine, so
P and D agree on what an id means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BASE = 0          # the id of "no adapter"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


class AdapterNameError(ValueError):
    """An adapter name or id that cannot be used; says what to change."""


@dataclass(frozen=True)
class AdapterRef:
    """One load of an adapter: its name, its id and where its weights were;
    `pinned`: never evicted from an engine's host memory or device slot."""
    name: str
    id: int
    path: str
    pinned: bool = False


class AdapterRegistry:
    """Names to the load currently under each. Pure bookkeeping: what is
    on the device (slots) is the executor's."""

    def __init__(self, base_name: str = ""):
        self.base_name = base_name
        self._by_name: dict[str, AdapterRef] = {}
        self._by_id: dict[int, AdapterRef] = {}
        self._last_id = BASE

    @classmethod
    def from_config(cls, adapters: dict, base_name: str = "") -> AdapterRegistry:
        """The configured adapters (name -> path), ids 1.. in their order."""
        reg = cls(base_name)
        for name, path in adapters.items():
            reg.load(name, path)
        return reg

    def load(self, name: str, path: str, id: int | None = None,
             pinned: bool = False) -> AdapterRef:
        """Register `name` at `path` under a fresh id (`id`: one issued
        elsewhere, above every id seen here). A name already loaded is
        replaced: its old id stops resolving."""
        if not _NAME.match(name):
            raise AdapterNameError(f"adapter name {name!r} is not usable: use 1-128 letters, "
                                   "digits and . _ : / @ + -, starting with a letter or digit")
        if name == self.base_name:
            raise AdapterNameError(f"adapter name {name!r} is the base model's name; "
                                   "give the adapter its own name")
        if id is None:
            id = self._last_id + 1
        elif id <= self._last_id:
            raise AdapterNameError(f"adapter id {id} for {name!r} is not new (the last id "
                                   f"issued here is {self._last_id}); ids are never reused")
        self._last_id = id
        old = self._by_name.pop(name, None)
        if old is not None:
            del self._by_id[old.id]
        ref = AdapterRef(name, id, str(path), pinned)
        self._by_name[name] = ref
        self._by_id[id] = ref
        return ref

    def next_id(self) -> int:
        """An id no load here has had (for a load issued here and given to
        the engines before it is registered)."""
        return self._last_id + 1

    def unload(self, name: str) -> AdapterRef:
        ref = self._by_name.pop(name, None)
        if ref is None:
            raise KeyError(self.unknown(name))
        del self._by_id[ref.id]
        return ref

    def get(self, name: str) -> AdapterRef | None:
        return self._by_name.get(name)

    def by_id(self, id: int) -> AdapterRef | None:
        return self._by_id.get(id)

    def resolve(self, model: str) -> int:
        """The id a request's `model` selects: BASE for the base model's name
        or none at all; KeyError (saying which names exist) for an unknown one."""
        if not model or model == self.base_name:
            return BASE
        ref = self._by_name.get(model)
        if ref is None:
            raise KeyError(self.unknown(model))
        return ref.id

    def unknown(self, name: str) -> str:
        known = ", ".join([repr(self.base_name)] + [repr(n) for n in self._by_name])
        return f"model {name!r} is not served here; this deployment serves {known}"

    def refs(self) -> list[AdapterRef]:
        """Every loaded adapter, oldest load first."""
        return sorted(self._by_name.values(), key=lambda r: r.id)

    def __len__(self) -> int:
        return len(self._by_name)
