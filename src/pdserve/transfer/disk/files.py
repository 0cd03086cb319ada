"""`FileStore`: the disk tier's files in one directory under a byte
capacity, least recently used evicted first, and the check that the
configured directory can hold them (`check_directory`)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

from pdserve.transfer.disk.store import (
    SUFFIX, TMP_MARK, DiskKey, DiskStore, DiskStoreError, Miss, decode, encode)


def check_directory(path) -> Path:
    """`path` as a directory this process can create files in, or a
    DiskStoreError saying why not and what to change."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DiskStoreError(f"engine.disk_cache.path={str(path)!r} cannot be created "
                             f"({e.strerror or e}); give a writable directory") from e
    if not p.is_dir():
        raise DiskStoreError(f"engine.disk_cache.path={str(path)!r} is not a directory; "
                             "give a directory")
    probe = p / f"probe{TMP_MARK}{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DiskStoreError(f"engine.disk_cache.path={str(path)!r} is not writable "
                             f"({e.strerror or e}); give a directory this engine can "
                             "write, or fix its permissions") from e
    return p


class FileStore(DiskStore):
    """Files in one directory (local NVMe or tmpfs), at most `max_bytes` of
    them: a put over the capacity evicts the least recently used first (a
    read refreshes a file's place, and its mtime, so the order survives a
    restart). Temporary files a killed writer left behind are removed at
    start; files of other engines sharing the directory are read like ours.
    Only the write lane writes, renames and evicts; the read lane reads."""

    def __init__(self, path, max_bytes: int, lanes: bool = True):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise DiskStoreError(f"engine.disk_cache.max_bytes must be a positive integer, "
                                 f"got {max_bytes!r}")
        self.path = check_directory(path)
        self.max_bytes = max_bytes
        # file name -> size, least recently used first
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0
        # the LRU index and byte count: the read lane refreshes, the write lane evicts
        self._meta = threading.RLock()
        self._scan()
        super().__init__(lanes)

    def _scan(self) -> None:
        """Forget leftover temporary files (a writer killed mid-write: they
        were never renamed, so nobody reads them) and index the rest by age."""
        found = []
        for f in self.path.iterdir():
            if TMP_MARK in f.name:
                pid = f.name.rsplit(".", 1)[-1]
                if not (pid.isdigit() and _alive(int(pid))):
                    f.unlink(missing_ok=True)
                continue
            if f.name.endswith(SUFFIX):
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, f.name, st.st_size))
        for _, name, size in sorted(found):
            self._lru[name] = size
            self.bytes += size

    def files(self) -> int:
        return len(self._lru)

    def _exists(self, key: DiskKey) -> bool:
        return (self.path / key.name()).is_file()

    def _absent(self, key: DiskKey) -> bool:
        return not os.path.lexists(self.path / key.name())     # one stat, no read

    def _get(self, key: DiskKey) -> tuple[bytes | None, Miss | None]:
        name = key.name()
        f = self.path / name
        try:
            raw = f.read_bytes()
        except FileNotFoundError:
            self._forget(name)
            return None, Miss.ABSENT
        payload, miss = decode(key, raw)
        if payload is None:
            self.stats.removed_bad += 1
            f.unlink(missing_ok=True)
            self._forget(name)
            return None, miss
        try:
            os.utime(f)                     # the LRU order a restart reads
        except FileNotFoundError:           # evicted since it was read: still a whole read
            self._forget(name)
            return payload, None
        with self._meta:
            if name not in self._lru:
                self._lru[name] = len(raw)  # another engine wrote it
                self.bytes += len(raw)
            self._lru.move_to_end(name)
        return payload, None

    def _put(self, key: DiskKey, data: bytes) -> str:
        raw = encode(key, data)
        if len(raw) > self.max_bytes:
            return (f"a {len(raw)}-byte page exceeds engine.disk_cache.max_bytes="
                    f"{self.max_bytes}")
        name = key.name()
        with self._meta:
            self._forget(name)
            while self.bytes + len(raw) > self.max_bytes and self._lru:
                old, size = self._lru.popitem(last=False)
                self.bytes -= size
                (self.path / old).unlink(missing_ok=True)
                self.stats.evictions += 1
        tmp = self.path / f"{name}{TMP_MARK}{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(raw)
        os.replace(tmp, self.path / name)
        with self._meta:
            self._lru[name] = len(raw)
            self.bytes += len(raw)
        return ""

    def _delete(self, key: DiskKey) -> bool:
        name = key.name()
        self._forget(name)
        try:
            (self.path / name).unlink()
            return True
        except FileNotFoundError:
            return False

    def _forget(self, name: str) -> None:
        with self._meta:
            size = self._lru.pop(name, None)
            if size is not None:
                self.bytes -= size


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
