"""The disk (L3) KV tier's storage: keys, the file format, and backends
whose operations complete asynchronously.

    job = store.submit(DiskOp.GET, key)     # returns at once
    ...                                     # the engine loop goes on
    for done in store.poll():               # completions, in the order they ended
        ...                                 # or store.wait(job, timeout_s)

A page (or a state slot) is stored under a `DiskKey`: the chain hash of the
prefix the page ends (the request's own hash chain, so whatever salts that
chain, an adapter say, salts the key), its cache group, and what makes the
bytes meaningful: the model's weights fingerprint, the dtype, the page
layout and the tensor-parallel shard (rank and size). Every engine that points at the same directory with the same model
shares its files.

A file is written to a temporary name and renamed, so a reader sees a whole
file or none. It starts with a header naming its key and the payload's
length and checksum; a file that is torn, corrupt or written for another
key, model, dtype or layout is a miss, and is removed, never loaded.

`FileStore` (transfer/disk/files.py) keeps files in one directory under a byte capacity, evicting the
least recently used; `FakeStore` (transfer/disk/fake.py) keeps them in
memory and injects faults, for tests. Both run their operations behind the
same `DiskStore` contract: reads and writes on separate worker threads
(`Lane`), so a read never waits for the write-through backlog.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum

MAGIC = b"PDKV\x02"     # 2: the header names the tensor-parallel shard
_LEN = struct.Struct("<I")
SUFFIX = ".kv"
TMP_MARK = ".tmp."


class DiskStoreError(RuntimeError):
    """The store cannot be used as configured (the message says why)."""


@dataclass(frozen=True)
class DiskKey:
    chain: int          # chain hash of the prefix the page ends (scheduler/cache/prefix.py)
    group: int          # the cache group whose page (or state slot) this is
    model: str          # the weights fingerprint
    dtype: str          # e.g. "float32"
    layout: str         # the page's shape, e.g. "kv:30x2x16x3x64"
    # The tensor-parallel shard: a TP engine's rank holds its own heads of
    # a page, so rank r of size t shares files only with rank r of size t
    # (the layout alone may not tell: a replicated KV head has the same
    # shape on every rank and size).
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        if not (isinstance(self.tp_size, int) and self.tp_size >= 1
                and isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"a disk key's tensor-parallel shard must be a rank in "
                             f"[0, tp_size) of tp_size >= 1, got rank {self.tp_rank!r} of "
                             f"{self.tp_size!r}")

    def name(self) -> str:
        """The file name: a digest of every field, so keys that differ in
        any field never share a file."""
        text = (f"{self.chain}|{self.group}|{self.model}|{self.dtype}|{self.layout}"
                f"|tp{self.tp_rank}/{self.tp_size}")
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest() + SUFFIX

    def header(self) -> dict:
        return {"chain": self.chain, "group": self.group, "model": self.model,
                "dtype": self.dtype, "layout": self.layout, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size}


class DiskOp(Enum):
    EXISTS = "exists"
    GET = "get"
    PUT = "put"
    DELETE = "delete"


class Miss(Enum):
    """Why a GET (or EXISTS) found nothing usable."""
    ABSENT = "absent"           # no such file
    TORN = "torn"               # shorter than its header says (a write cut short)
    CORRUPT = "corrupt"         # the payload's checksum does not match
    FOREIGN = "foreign"         # written for another key, model, dtype or layout
    DROPPED = "dropped"         # the backend lost the operation (fake backend)


@dataclass(frozen=True)
class DiskDone:
    """One finished operation. `ok`: EXISTS found it, GET read it (`data`),
    PUT stored it (False: nothing stored, `error` says why), DELETE removed
    it."""
    job: int
    op: DiskOp
    key: DiskKey
    ok: bool
    data: bytes | None = None
    miss: Miss | None = None
    error: str = ""


@dataclass
class DiskStats:
    """What a store counts (read by the engine's metrics)."""
    gets: int = 0
    hits: int = 0
    bytes_read: int = 0
    puts: int = 0
    bytes_written: int = 0
    evictions: int = 0
    removed_bad: int = 0        # torn, corrupt or foreign files removed on read
    failed_puts: int = 0
    read_unwritten: int = 0     # GETs answered from a PUT still queued (counted in hits)


def encode(key: DiskKey, payload: bytes) -> bytes:
    """A file's bytes: magic, header length, JSON header, payload."""
    head = key.header() | {"nbytes": len(payload),
                           "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}
    hb = json.dumps(head, sort_keys=True).encode()
    return MAGIC + _LEN.pack(len(hb)) + hb + payload


def decode(key: DiskKey, raw: bytes) -> tuple[bytes | None, Miss | None]:
    """The payload of a file's bytes if they are whole, intact and written
    for `key`; else (None, why)."""
    n0 = len(MAGIC) + _LEN.size
    if len(raw) < n0 or raw[:len(MAGIC)] != MAGIC:
        return None, Miss.TORN if len(raw) < n0 else Miss.FOREIGN
    (hlen,) = _LEN.unpack_from(raw, len(MAGIC))
    if len(raw) < n0 + hlen:
        return None, Miss.TORN
    try:
        head = json.loads(raw[n0:n0 + hlen])
    except ValueError:
        return None, Miss.CORRUPT
    if not isinstance(head, dict) or any(head.get(k) != v for k, v in key.header().items()):
        return None, Miss.FOREIGN
    payload = raw[n0 + hlen:]
    if len(payload) != head.get("nbytes"):
        return None, Miss.TORN
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != head.get("blake2b"):
        return None, Miss.CORRUPT
    return payload, None


class Lane(Enum):
    """Which worker runs an operation. Reads are what a request waits for;
    writes (write-through) nobody waits for: each lane has its own queue and
    thread, so a read never queues behind the write backlog."""
    READ = "read"       # GET, EXISTS
    WRITE = "write"     # PUT, DELETE (in submission order, so a DELETE follows its PUT)


LANES = {DiskOp.GET: Lane.READ, DiskOp.EXISTS: Lane.READ,
         DiskOp.PUT: Lane.WRITE, DiskOp.DELETE: Lane.WRITE}


class DiskStore(abc.ABC):
    """The contract: `submit` queues an operation and returns its job id at
    once; a worker thread per lane (`Lane`) carries its lane's operations
    out in submission order; `poll` hands back what finished, `wait` blocks
    for one job. A GET or EXISTS of a key whose PUT is still queued is
    answered from the queued bytes (a store reads its own writes).
    Subclasses implement the blocking `_exists`, `_get`, `_put` and
    `_delete`; the two lanes call them from two threads."""

    def __init__(self, lanes: bool = True):
        """`lanes=False`: every operation on the write lane, in submission
        order (one FIFO worker, as before the lanes: `pdserve bench disk`
        compares the two)."""
        self.stats = DiskStats()
        self._lanes = lanes
        self._queues: dict[Lane, deque] = {lane: deque() for lane in Lane}
        self._pending: set[int] = set()                 # submitted, not finished
        self._unwritten: dict[str, tuple[int, bytes]] = {}  # file name -> (PUT job, bytes)
        self._done: dict[int, DiskDone] = {}
        self._order: deque[int] = deque()
        self._cv = threading.Condition()
        self._next = 0
        self._closed = False
        self._writes_paused = False
        self._threads = [threading.Thread(target=self._work, args=(lane,),
                                          name=f"disk-{lane.value}", daemon=True)
                         for lane in Lane]
        for t in self._threads:
            t.start()

    # ---- the contract -------------------------------------------------------
    def submit(self, op: DiskOp, key: DiskKey, data: bytes | None = None) -> int:
        if not isinstance(op, DiskOp):
            raise TypeError(f"op must be a DiskOp, got {op!r}")
        if (op is DiskOp.PUT) != (data is not None):
            raise ValueError("a PUT carries bytes; no other operation does")
        with self._cv:
            if self._closed:
                raise DiskStoreError("the disk store is closed")
            self._next += 1
            job = self._next
            if op is DiskOp.PUT:
                assert data is not None
                self._unwritten[key.name()] = (job, data)
            elif op is DiskOp.DELETE:
                self._unwritten.pop(key.name(), None)
            self._pending.add(job)
            self._queues[LANES[op] if self._lanes else Lane.WRITE].append((job, op, key, data))
            self._cv.notify_all()
            return job

    def poll(self) -> list[DiskDone]:
        """Every completion not yet handed out (by poll or wait)."""
        with self._cv:
            out = [self._done.pop(j) for j in self._order if j in self._done]
            self._order.clear()
            return out

    def wait(self, job: int, timeout_s: float | None = None) -> DiskDone | None:
        """Job `job`'s completion (handed out here, not by a later poll), or
        None if it has not finished within `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while job not in self._done:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cv.wait(left)
            return self._done.pop(job)

    def wait_ended(self, jobs, timeout_s: float) -> bool:
        """Block until every job of `jobs` ended (or `timeout_s`), leaving
        their completions for `poll`."""
        jobs = set(jobs)
        with self._cv:
            return self._cv.wait_for(lambda: self._pending.isdisjoint(jobs), timeout_s)

    def wait_any(self, timeout_s: float) -> bool:
        """Block until some completion is ready to poll (or `timeout_s`)."""
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._done), timeout_s)

    def pending(self) -> int:
        """Operations submitted and not finished."""
        with self._cv:
            return len(self._pending)

    def queued_writes(self) -> int:
        """PUTs and DELETEs waiting for the write lane (the write backlog)."""
        with self._cv:
            return len(self._queues[Lane.WRITE])

    def absent(self, key: DiskKey) -> bool:
        """True when the store can tell at once (no read, a metadata lookup
        at most) that nothing is stored or queued under `key`; False when
        it may be there, or cannot tell cheaply (then ask with EXISTS or
        GET). A probe whose first page is absent reads nothing: an
        all-miss workload then costs no prefetch."""
        with self._cv:
            if key.name() in self._unwritten:
                return False
        return self._absent(key)

    def _absent(self, key: DiskKey) -> bool:
        return False                    # a backend that cannot tell cheaply

    def pause_writes(self, paused: bool) -> None:
        """Hold the write lane (it starts nothing new until resumed; close
        still finishes its queue). `pdserve bench disk` runs several
        engines interleaved and lets each one's writes run in its own turns
        only, as if it ran alone."""
        with self._cv:
            self._writes_paused = paused
            self._cv.notify_all()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Block until every submitted operation has finished."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending, timeout_s)

    def close(self) -> None:
        """Finish what was submitted, then stop the workers."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()

    # ---- the workers ----------------------------------------------------------
    def _work(self, lane: Lane) -> None:
        if lane is Lane.WRITE and self._lanes:
            _lowest_priority()
        queue = self._queues[lane]
        while True:
            with self._cv:
                while not self._closed and (
                        not queue or (lane is Lane.WRITE and self._writes_paused)):
                    self._cv.wait()
                if not queue:
                    return
                job, op, key, data = queue.popleft()
            try:
                done = self._run(job, op, key, data)
            except OSError as e:
                done = DiskDone(job, op, key, False, error=f"{type(e).__name__}: {e}")
            with self._cv:
                if op is DiskOp.PUT and self._unwritten.get(key.name(), (0,))[0] == job:
                    del self._unwritten[key.name()]     # on disk now (or failed)
                self._pending.discard(job)
                self._done[job] = done
                self._order.append(job)
                self._cv.notify_all()

    def _queued(self, key: DiskKey) -> bytes | None:
        """The bytes of `key`'s PUT still queued or running, if any."""
        with self._cv:
            u = self._unwritten.get(key.name())
            return u[1] if u is not None else None

    def _run(self, job: int, op: DiskOp, key: DiskKey, data: bytes | None) -> DiskDone:
        s = self.stats
        if op is DiskOp.GET:
            s.gets += 1
            payload = self._queued(key)
            if payload is not None:
                s.read_unwritten += 1
                miss = None
            else:
                payload, miss = self._get(key)
            if payload is not None:
                s.hits += 1
                s.bytes_read += len(payload)
            return DiskDone(job, op, key, payload is not None, payload, miss)
        if op is DiskOp.EXISTS:
            return DiskDone(job, op, key, self._queued(key) is not None or self._exists(key),
                            miss=None)
        if op is DiskOp.PUT:
            assert data is not None                     # submit checked it
            err = self._put(key, data)
            if err:
                s.failed_puts += 1
            else:
                s.puts += 1
                s.bytes_written += len(data)
            return DiskDone(job, op, key, not err, error=err)
        return DiskDone(job, op, key, self._delete(key))

    # ---- what a backend implements ---------------------------------------------
    @abc.abstractmethod
    def _exists(self, key: DiskKey) -> bool:
        """Whether a valid file for `key` is there."""

    @abc.abstractmethod
    def _get(self, key: DiskKey) -> tuple[bytes | None, Miss | None]:
        """The payload, or None and why it missed."""

    @abc.abstractmethod
    def _put(self, key: DiskKey, data: bytes) -> str:
        """Store `data`; '' on success, else why not."""

    @abc.abstractmethod
    def _delete(self, key: DiskKey) -> bool:
        """Remove `key`'s file; whether there was one."""


def _lowest_priority() -> None:
    """The calling thread at the lowest CPU priority (Linux: nice 19 for
    this thread alone): write-through then never takes a core from the
    engine's forward, and a disk that falls behind fills the write backlog,
    whose bound drops writes (engine/disk/tier.py), instead of slowing
    requests. Elsewhere, or where refused, the thread keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass
