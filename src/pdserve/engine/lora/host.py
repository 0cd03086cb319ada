"""An engine's LoRA adapters in host memory: at most `max_cpu_loras` kept,
the least recently used unpinned one evicted past that, and re-read from
its PEFT directory when a round next needs it in a device slot.

A load id stands for the weights read at load time. An evicted adapter is
read again from the same path, so a directory rewritten since would put
other weights under the old id and break the cache isolation the id gives
(scheduler/lora/adapters.py). Each load therefore records its files' sizes and
modification times when first read, and a re-read whose files differ is
refused (`AdapterChanged`, saying to load the new files under a new load).

Pinned adapters are never evicted (nor counted against the capacity's
evictable part); the config and the runtime load check that they fit.
When a request under an evicted adapter arrives, `prefetch` starts its
re-read on a reader thread, so the round that needs it in a slot usually
finds it held; `get` waits for a read under way, or reads itself.
The forward thread reads (`get`), the loop thread adds, drops and
prefetches, the reader thread lands its reads; one lock keeps the table
whole, and no file is read under it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pdserve.kernels.lora.adapter import AdapterError, LoraAdapter

FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterChanged(AdapterError):
    """An evicted adapter's directory no longer holds the weights its load read."""


def fingerprint(path: str) -> tuple:
    """What identifies the files a load read: each one's size and mtime."""
    out: list[tuple[str, int | None, int | None]] = []
    for name in FILES:
        try:
            st = os.stat(Path(path) / name)
        except OSError:
            out.append((name, None, None))
        else:
            out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


@dataclass
class _Entry:
    path: str
    stamp: tuple                    # fingerprint at the first read
    pinned: bool


class HostAdapters:
    """Load id -> weights, an LRU of `capacity` unpinned-or-pinned entries.
    `read`: a PEFT directory to weights (the engine's load_adapter)."""

    def __init__(self, capacity: int, read: Callable[[str], LoraAdapter]):
        if capacity < 1:
            raise ValueError(f"host adapter capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._read = read
        self._known: dict[int, _Entry] = {}
        self._held: OrderedDict[int, LoraAdapter] = OrderedDict()   # oldest use first
        self._lock = threading.Lock()
        self._reading: dict[int, Future] = {}      # prefetches under way
        self._reader: ThreadPoolExecutor | None = None
        self.reads = 0              # re-reads of evicted adapters
        self.evictions = 0

    def add(self, adapter_id: int, path: str, weights: LoraAdapter, pinned: bool = False,
            stamp: tuple | None = None) -> None:
        """Hold load `adapter_id`'s `weights`, read from `path` (`stamp`:
        its fingerprint taken before the read; now, if not given)."""
        with self._lock:
            if pinned and self._pinned() >= self.capacity:
                raise ValueError(f"cannot pin another LoRA adapter: {self._pinned()} pinned "
                                 f"already fill lora.max_cpu_loras={self.capacity}; raise it "
                                 "or unpin one")
            self._known[adapter_id] = _Entry(path, stamp if stamp is not None
                                             else fingerprint(path), pinned)
            self._held[adapter_id] = weights
            self._held.move_to_end(adapter_id)
            self._evict(keep=adapter_id)

    def get(self, adapter_id: int) -> LoraAdapter:
        """Load `adapter_id`'s weights, re-read if evicted (waiting for a
        prefetch under way); AdapterChanged when its directory changed
        since the load."""
        with self._lock:
            w = self._held.get(adapter_id)
            if w is not None:
                self._held.move_to_end(adapter_id)
                return w
            e = self._known.get(adapter_id)
            if e is None:
                raise KeyError(f"no LoRA adapter load {adapter_id} on this engine")
            fut = self._reading.get(adapter_id)
            if fut is None:
                self._check_unchanged(adapter_id, e)
        if fut is not None:
            try:
                w = fut.result()
            except Exception:               # read again here: its error is the round's
                w = self._reread(e.path)
        else:
            w = self._reread(e.path)
        self._land(adapter_id, w)
        return w

    def prefetch(self, adapter_id: int) -> None:
        """Start re-reading load `adapter_id` on the reader thread if it is
        evicted (a request under it just arrived); AdapterChanged, at once,
        if its directory changed since the load."""
        with self._lock:
            e = self._known.get(adapter_id)
            if e is None or adapter_id in self._held or adapter_id in self._reading:
                return
            self._check_unchanged(adapter_id, e)
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
            fut = self._reader.submit(self._reread, e.path)
            self._reading[adapter_id] = fut
        fut.add_done_callback(lambda f: self._landed(adapter_id, f))

    def _reread(self, path: str) -> LoraAdapter:
        w = self._read(path)
        with self._lock:
            self.reads += 1
        return w

    def _landed(self, adapter_id: int, fut: Future) -> None:
        """A prefetch finished: hold what it read (a failed one is read
        again by `get`, which reports the error)."""
        if fut.exception() is None:
            self._land(adapter_id, fut.result())
        with self._lock:
            if self._reading.get(adapter_id) is fut:
                del self._reading[adapter_id]

    def _land(self, adapter_id: int, w: LoraAdapter) -> None:
        with self._lock:
            if adapter_id in self._known and adapter_id not in self._held:
                self._held[adapter_id] = w
                self._evict(keep=adapter_id)
            if adapter_id in self._held:
                self._held.move_to_end(adapter_id)

    def verify(self, adapter_id: int) -> None:
        """AdapterChanged if load `adapter_id` is evicted and its directory
        changed since: checked when a request under it arrives, so it is
        refused then rather than failing the round that would re-read it."""
        with self._lock:
            e = self._known.get(adapter_id)
            if e is not None and adapter_id not in self._held:
                self._check_unchanged(adapter_id, e)

    def _check_unchanged(self, adapter_id: int, e: _Entry) -> None:
        if fingerprint(e.path) != e.stamp:
            raise AdapterChanged(
                f"LoRA adapter load {adapter_id} was evicted from host memory and its "
                f"directory {e.path!r} has changed since it was loaded; load the new "
                "files as a new load (POST /v1/load_lora_adapter) or keep the "
                "directory unchanged while the load is served")

    def drop(self, adapter_id: int) -> None:
        """Forget an unloaded load."""
        with self._lock:
            self._known.pop(adapter_id, None)
            self._held.pop(adapter_id, None)

    def held(self) -> list[int]:
        """The loads in host memory now, least recently used first."""
        with self._lock:
            return list(self._held)

    def pinned(self, adapter_id: int) -> bool:
        e = self._known.get(adapter_id)
        return e is not None and e.pinned

    def _pinned(self) -> int:
        return sum(1 for e in self._known.values() if e.pinned)

    def _evict(self, keep: int) -> None:
        """Past capacity, drop least recently used unpinned loads (never
        `keep`, which its caller is about to use)."""
        for adapter_id in list(self._held):
            if len(self._held) <= self.capacity:
                return
            if adapter_id != keep and not self._known[adapter_id].pinned:
                del self._held[adapter_id]
                self.evictions += 1

    def check_invariants(self) -> None:
        with self._lock:
            unpinned = [a for a in self._held if not self._known[a].pinned]
            if len(self._held) > self.capacity and len(unpinned) > 1:
                raise AssertionError(f"{len(self._held)} adapters held in host memory, over "
                                     f"its capacity {self.capacity}, with {unpinned} evictable")
            if not all(e.pinned <= (a in self._held) for a, e in self._known.items()):
                raise AssertionError("a pinned LoRA adapter was evicted from host memory")
