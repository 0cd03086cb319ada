"""The disk tier's storage (transfer/disk/store.py): keys, the file format,
the file backend's writes, reads, eviction and restart, and the fake
backend's faults."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pdserve.kernels.kv_cache import KVCache
from pdserve.kernels.models.state_cache import StateCache
from pdserve.transfer.disk.fake import FakeStore, Faults
from pdserve.transfer.disk.files import FileStore
from pdserve.transfer.disk.store import DiskKey, DiskOp, DiskStoreError, Miss, decode, encode


def key(chain: int, group: int = 0, model: str = "w1", layout: str = "kv:2x2x4x1x8") -> DiskKey:
    return DiskKey(chain, group, model, "float32", layout)


def run(store, op, k, data=None):
    return store.wait(store.submit(op, k, data), timeout_s=10)


@pytest.fixture
def store(tmp_path):
    s = FileStore(tmp_path / "kv", max_bytes=1 << 20)
    yield s
    s.close()


def _random_kv(layers: int, pages: int, dtype=torch.float32) -> KVCache:
    c = KVCache(layers, pages, 4, 2, 8, dtype, "cpu")
    c.data.copy_(torch.randn(c.data.shape).to(dtype))
    return c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_history_page_round_trips_byte_equal(store, dtype):
    """A full-history page written to disk and read into another pool's
    page is byte for byte the page written."""
    src, dst = _random_kv(3, 4, dtype), KVCache(3, 4, 4, 2, 8, dtype, "cpu")
    k = key(101, layout=src.layout())
    assert run(store, DiskOp.PUT, k, src.read_page(2)).ok
    got = run(store, DiskOp.GET, k)
    assert got.ok and got.miss is None
    dst.write_page(0, got.data)
    assert torch.equal(dst.data[0].view(torch.uint8), src.data[2].view(torch.uint8))


def test_sliding_window_tail_round_trips_byte_equal(store):
    """A sliding group's window tail (its last pages, its own layers) comes
    back byte-equal, under keys of its own group."""
    src, dst = _random_kv(1, 6), KVCache(1, 6, 4, 2, 8, torch.float32, "cpu")
    tail = [3, 4, 5]
    for i, p in enumerate(tail):
        assert run(store, DiskOp.PUT, key(200 + i, group=1, layout=src.layout()),
                   src.read_page(p)).ok
    for i, p in enumerate(tail):
        got = run(store, DiskOp.GET, key(200 + i, group=1, layout=src.layout()))
        dst.write_page(i, got.data)
    assert torch.equal(dst.data[:3], src.data[3:6])
    # the same chain hash in the full-history group is another key
    assert not run(store, DiskOp.GET, key(200, group=0, layout=src.layout())).ok


def test_state_checkpoint_round_trips_byte_equal(store):
    """A state checkpoint (conv in the model dtype, recurrent in float32)
    comes back byte-equal."""
    src = StateCache(3, 2, (6, 3), (2, 4, 4), torch.bfloat16, "cpu")
    src.conv.copy_(torch.randn(src.conv.shape).to(torch.bfloat16))
    src.recurrent.copy_(torch.randn(src.recurrent.shape))
    dst = StateCache(3, 2, (6, 3), (2, 4, 4), torch.bfloat16, "cpu")
    k = key(7, group=2, layout=src.layout())
    assert run(store, DiskOp.PUT, k, src.read_slot(1)).ok
    dst.write_slot(2, run(store, DiskOp.GET, k).data)
    assert torch.equal(dst.conv[2], src.conv[1]) and torch.equal(dst.recurrent[2], src.recurrent[1])


def test_operations_complete_asynchronously_and_are_polled(tmp_path):
    """submit returns at once; poll hands back every completion once; each
    lane runs its operations in submission order."""
    s = FakeStore(Faults(latency_s=0.01))
    jobs = [s.submit(DiskOp.PUT, key(i), bytes([i]) * 16) for i in range(3)]
    jobs.append(s.submit(DiskOp.EXISTS, key(1)))
    assert s.drain()
    done = s.poll()
    assert sorted(d.job for d in done) == jobs
    assert [d.job for d in done if d.op is DiskOp.PUT] == jobs[:3]
    assert all(d.ok for d in done)
    assert s.poll() == []
    s.close()


def test_a_read_never_waits_for_the_write_backlog():
    """Reads run on their own lane: a GET ends while every PUT before it
    is still queued behind a write that cannot finish."""
    gate = threading.Event()
    s = FakeStore(Faults(writes_open=gate))
    gate.set()
    run(s, DiskOp.PUT, key(0), b"old" * 10)
    gate.clear()
    s.writing.clear()
    writes = [s.submit(DiskOp.PUT, key(i), bytes([i]) * 16) for i in range(1, 6)]
    assert s.writing.wait(10)
    d = run(s, DiskOp.GET, key(0))
    assert d.ok and d.data == b"old" * 10
    assert s.queued_writes() == 4 and s.pending() == 5
    gate.set()
    assert s.drain() and {d.job for d in s.poll()} == set(writes)
    s.close()


def test_a_read_of_a_queued_write_gets_its_bytes():
    """A GET or EXISTS of a key whose PUT is still queued is answered from
    the queued bytes, so a store reads its own writes before they land."""
    gate = threading.Event()
    s = FakeStore(Faults(writes_open=gate))
    s.submit(DiskOp.PUT, key(1), b"first" * 4)
    s.submit(DiskOp.PUT, key(2), b"second" * 4)
    assert s.writing.wait(10)
    assert run(s, DiskOp.GET, key(2)).data == b"second" * 4
    assert run(s, DiskOp.EXISTS, key(1)).ok and not run(s, DiskOp.EXISTS, key(3)).ok
    assert s.stats.read_unwritten == 1
    gate.set()
    assert s.drain()
    assert run(s, DiskOp.GET, key(2)).data == b"second" * 4 and s.stats.read_unwritten == 1
    s.close()


def test_the_file_store_reads_while_it_writes(tmp_path):
    """The file backend under both lanes at once: every page written is
    read back whole, and the byte count matches the files kept."""
    s = FileStore(tmp_path / "kv", max_bytes=1 << 20)
    pages = {i: os.urandom(4096) for i in range(64)}
    for i, b in pages.items():
        s.submit(DiskOp.PUT, key(i), b)
    reads = [s.submit(DiskOp.GET, key(i)) for i in pages]
    assert s.drain()
    got = {d.key.chain: d.data for d in s.poll() if d.job in reads and d.ok}
    assert all(got[i] == pages[i] for i in got)
    assert all(run(s, DiskOp.GET, key(i)).data == b for i, b in pages.items())
    assert s.bytes == sum(f.stat().st_size for f in (tmp_path / "kv").iterdir())
    s.close()


@pytest.mark.parametrize("damage,miss", [
    (lambda raw: raw[:len(raw) - 5], Miss.TORN),
    (lambda raw: raw[:-1] + bytes([raw[-1] ^ 0xFF]), Miss.CORRUPT),
    (lambda raw: raw[:4], Miss.TORN),
])
def test_a_damaged_file_is_a_miss_and_is_removed(store, damage, miss):
    k = key(5)
    assert run(store, DiskOp.PUT, k, b"x" * 64).ok
    f = store.path / k.name()
    f.write_bytes(damage(f.read_bytes()))
    got = run(store, DiskOp.GET, k)
    assert not got.ok and got.data is None and got.miss is miss
    assert not f.exists()
    assert store.stats.removed_bad == 1


def test_a_file_for_another_model_or_layout_is_foreign(store):
    """A file whose header names other weights (the same name forced) is a
    miss, never loaded, and removed."""
    k = key(9)
    other = key(9, model="w2")
    (store.path / k.name()).write_bytes(encode(other, b"y" * 32))
    got = run(store, DiskOp.GET, k)
    assert got.miss is Miss.FOREIGN and not (store.path / k.name()).exists()
    assert decode(key(9, layout="kv:9"), encode(k, b"z"))[1] is Miss.FOREIGN


def test_tensor_parallel_shards_never_read_each_others_files(store):
    """The key names the TP shard: a page written by rank 0 of a TP 2
    engine is not found by a TP 1 engine nor by rank 1 on the same
    directory, even where the layouts agree (a replicated KV head), and a
    file whose header names another shard is foreign."""
    layout = "kv:2x2x4x1x8"
    tp2_r0 = DiskKey(42, 0, "w1", "float32", layout, tp_rank=0, tp_size=2)
    assert run(store, DiskOp.PUT, tp2_r0, b"r0" * 16).ok
    for other in (key(42, layout=layout),
                  DiskKey(42, 0, "w1", "float32", layout, tp_rank=1, tp_size=2),
                  DiskKey(42, 0, "w1", "float32", layout, tp_rank=0, tp_size=4)):
        assert other.name() != tp2_r0.name()
        assert run(store, DiskOp.GET, other).miss is Miss.ABSENT
        assert decode(other, encode(tp2_r0, b"z"))[1] is Miss.FOREIGN
    assert run(store, DiskOp.GET, tp2_r0).data == b"r0" * 16
    with pytest.raises(ValueError, match="rank 2 of 2"):
        DiskKey(1, 0, "w1", "float32", layout, tp_rank=2, tp_size=2)


def test_writes_go_through_a_temporary_name(store, monkeypatch):
    """A writer that dies before its rename leaves only a temporary file,
    which no reader sees and the next start removes."""
    k = key(11)

    def die(src, dst):
        raise OSError("killed mid-write")
    monkeypatch.setattr(os, "replace", die)
    got = run(store, DiskOp.PUT, k, b"q" * 100)
    assert not got.ok and "killed" in got.error
    monkeypatch.undo()
    assert not run(store, DiskOp.GET, k).ok
    leftovers = [f for f in store.path.iterdir() if ".tmp." in f.name]
    assert leftovers
    # a restart by another process id: the dead writer's leftover goes
    for f in leftovers:
        f.rename(f.with_name(f.name.rsplit(".", 1)[0] + ".999999999"))
    store.close()
    again = FileStore(store.path, max_bytes=1 << 20)
    assert not [f for f in again.path.iterdir() if ".tmp." in f.name]
    again.close()


def test_capacity_evicts_least_recently_used(tmp_path):
    """Over max_bytes, a put evicts the least recently used file; a read
    refreshes a file's place."""
    one = len(encode(key(0), b"a" * 1000))
    s = FileStore(tmp_path, max_bytes=3 * one)
    for i in range(3):
        assert run(s, DiskOp.PUT, key(i), b"a" * 1000).ok
    assert run(s, DiskOp.GET, key(0)).ok           # 0 is now the most recent
    assert run(s, DiskOp.PUT, key(3), b"a" * 1000).ok
    assert not run(s, DiskOp.EXISTS, key(1)).ok     # 1 was the least recent
    assert all(run(s, DiskOp.EXISTS, key(i)).ok for i in (0, 2, 3))
    assert s.bytes == 3 * one and s.stats.evictions == 1
    s.close()


def test_restart_serves_the_files_left_and_keeps_their_order(tmp_path):
    s = FileStore(tmp_path, max_bytes=1 << 20)
    for i in range(3):
        run(s, DiskOp.PUT, key(i), bytes([i]) * 50)
    s.close()
    again = FileStore(tmp_path, max_bytes=1 << 20)
    assert again.files() == 3
    assert run(again, DiskOp.GET, key(2)).data == bytes([2]) * 50
    again.close()


def test_an_unwritable_directory_is_refused_with_the_reason(tmp_path, monkeypatch):
    """A path that cannot be written is refused at start, saying why (the
    probe write is refused here as a read-only mount would: tests may run
    as root, which permissions do not stop)."""
    import pathlib

    def refuse(self, data):
        raise PermissionError(13, "Permission denied")
    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "write_bytes", refuse)
        with pytest.raises(DiskStoreError, match="not writable .Permission denied.; give a "
                                                 "directory this engine can write"):
            FileStore(tmp_path / "ro", max_bytes=100)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(DiskStoreError, match="cannot be created"):
        FileStore(f / "sub", max_bytes=100)
    with pytest.raises(DiskStoreError, match="max_bytes must be a positive integer"):
        FileStore(tmp_path, max_bytes=0)


def test_fake_store_injects_drops_torn_and_stale_files():
    f = Faults()
    s = FakeStore(f)
    for i in range(4):
        run(s, DiskOp.PUT, key(i), bytes([i]) * 40)
    f.drop, f.torn, f.stale = {1}, {2}, {3}
    assert run(s, DiskOp.GET, key(0)).ok
    assert run(s, DiskOp.GET, key(1)).miss is Miss.DROPPED
    assert run(s, DiskOp.GET, key(2)).miss is Miss.TORN
    assert run(s, DiskOp.GET, key(3)).miss is Miss.FOREIGN
    # a torn or stale file was removed; a dropped read left its file
    assert run(s, DiskOp.EXISTS, key(1)).ok
    assert not run(s, DiskOp.EXISTS, key(2)).ok and not run(s, DiskOp.EXISTS, key(3)).ok
    s.close()


def test_paused_writes_wait_and_reads_go_on():
    """pause_writes holds the write lane; reads are served meanwhile; a
    resume (or close) lets the writes run."""
    s = FakeStore()
    run(s, DiskOp.PUT, key(0), b"a" * 8)
    s.pause_writes(True)
    job = s.submit(DiskOp.PUT, key(1), b"b" * 8)
    assert run(s, DiskOp.GET, key(0)).ok
    assert s.wait(job, timeout_s=0.05) is None and s.queued_writes() == 1
    s.pause_writes(False)
    assert s.wait(job, timeout_s=10).ok
    s.pause_writes(True)
    s.submit(DiskOp.PUT, key(2), b"c" * 8)
    s.close()                                   # finishes the queue though paused
    assert len(s.files) == 3
