"""The disk tier's fake backend, for tests: files in memory, in the file
format of `FileStore`, with injected faults (latency, dropped reads, torn
files, files of another model). It runs behind the same `DiskStore`
contract (transfer/disk/store.py) and the same two lanes."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from pdserve.transfer.disk.store import DiskKey, DiskOp, DiskStore, Miss, decode, encode


@dataclass
class Faults:
    """What `FakeStore` does wrong: a delay per operation, and per key the
    next GETs that are dropped, torn (the file is cut short) or stale (the
    file was written for other bytes than its key now names)."""
    latency_s: float = 0.0
    drop: set | None = None         # chain hashes whose GETs are dropped
    torn: set | None = None         # chain hashes whose files are torn on the next GET
    stale: set | None = None        # chain hashes whose files belong to another model
    # set: PUTs proceed; clear: each PUT waits in the write lane until it is set
    writes_open: threading.Event | None = None


class FakeStore(DiskStore):
    """Files in memory (name -> bytes), with injected faults (`faults`,
    changeable while it runs)."""

    def __init__(self, faults: Faults | None = None, max_bytes: int = 1 << 40):
        self.faults = faults or Faults()
        self.max_bytes = max_bytes
        self.files: OrderedDict[str, bytes] = OrderedDict()
        self.log: list[tuple[DiskOp, int]] = []     # (op, chain) of every operation run
        self._files_lock = threading.Lock()         # the two lanes share `files`
        self.writing = threading.Event()            # a PUT has started (tests wait on it)
        super().__init__()

    def reopened(self) -> FakeStore:
        """A second handle on the same files, faults and log, as a second
        FileStore opened on one directory: closing one (an engine that
        stops) leaves the other open."""
        other = FakeStore(self.faults, self.max_bytes)
        other.files, other.log, other._files_lock = self.files, self.log, self._files_lock
        other.writing = self.writing
        return other

    def _delay(self) -> None:
        if self.faults.latency_s:
            time.sleep(self.faults.latency_s)   # the injected latency itself

    def _exists(self, key: DiskKey) -> bool:
        self._delay()
        self.log.append((DiskOp.EXISTS, key.chain))
        with self._files_lock:
            return key.name() in self.files

    def _get(self, key: DiskKey) -> tuple[bytes | None, Miss | None]:
        self._delay()
        self.log.append((DiskOp.GET, key.chain))
        f = self.faults
        if f.drop and key.chain in f.drop:
            return None, Miss.DROPPED
        name = key.name()
        with self._files_lock:
            raw = self.files.get(name)
        if raw is None:
            return None, Miss.ABSENT
        if f.torn and key.chain in f.torn:
            raw = raw[:len(raw) // 2]
        if f.stale and key.chain in f.stale:
            raw = encode(replace(key, model=key.model + "-old"), raw[-8:])
        payload, miss = decode(key, raw)
        with self._files_lock:
            if payload is None:
                self.stats.removed_bad += 1
                self.files.pop(name, None)
                return None, miss
            if name in self.files:
                self.files.move_to_end(name)
        return payload, None

    def _put(self, key: DiskKey, data: bytes) -> str:
        self.writing.set()
        gate = self.faults.writes_open
        if gate is not None:
            gate.wait()
        self._delay()
        self.log.append((DiskOp.PUT, key.chain))
        raw = encode(key, data)
        with self._files_lock:
            self.files.pop(key.name(), None)
            while self.files and sum(map(len, self.files.values())) + len(raw) > self.max_bytes:
                self.files.popitem(last=False)
                self.stats.evictions += 1
            self.files[key.name()] = raw
        return ""

    def _delete(self, key: DiskKey) -> bool:
        self._delay()
        with self._files_lock:
            return self.files.pop(key.name(), None) is not None
