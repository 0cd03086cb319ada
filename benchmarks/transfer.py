"""KV handoff bandwidth between two processes over NIXL (UCX, host memory).

For each size, the same bytes three ways, side by side:
  handoff   NixlTransport.write of N pages scattered through a larger pool
            (descriptors prepared once; the write names page indices)
  raw NIXL  one WRITE of one contiguous buffer of the same bytes
  memcpy    an in-process copy of the same bytes
Pools: the tiny model's (8 KiB pages) and a Llama-3-8B-shaped one (32
layers, 8 KV heads, 128 dims, bf16, 16-token pages: 2 MiB a page).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from pdserve.transfer import Incarnation, KvWrite
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.peer_process import make_pool, spawn

POOLS = {
    "tiny": dict(shape=(2, 2, 16, 2, 16), dtype="float32", pages=4096, sizes=(1, 16, 256, 1024)),
    "llama-3-8b": dict(shape=(32, 2, 16, 8, 128), dtype="bfloat16", pages=384,
                       sizes=(1, 16, 128)),
}
REPEATS = 7


def _wait_done(t: NixlTransport) -> None:
    while True:
        for ev in t.poll():
            if ev.kind == "failed":
                raise RuntimeError(f"transfer failed: {ev.reason}")
            return


def _bench_pool(name: str, spec: dict, rng: np.random.Generator) -> list[dict]:
    dtype = getattr(torch, spec["dtype"])
    biggest = max(spec["sizes"])
    page_bytes = int(np.prod(spec["shape"])) * torch.tensor([], dtype=dtype).element_size()
    proc, conn, md, raw_remote = spawn(f"bench-d-{name}", 1, spec["pages"], spec["shape"],
                                       spec["dtype"], raw_bytes=biggest * page_bytes)
    p = NixlTransport(Incarnation(f"bench-p-{name}", 1))
    pool = make_pool(spec["pages"], spec["shape"], dtype)
    p.register_pool(pool)
    d_inc = Incarnation(f"bench-d-{name}", 1)
    p.add_peer(d_inc, md)
    conn.send((p.incarnation, p.metadata()))
    raw = torch.ones(biggest * page_bytes, dtype=torch.uint8)
    p.agent.register_memory(raw)
    d_name = d_inc.agent_name
    rows = []
    for n in spec["sizes"]:
        nbytes = n * page_bytes
        hand, setup = [], []
        for r in range(REPEATS):
            src = tuple(int(x) for x in rng.choice(spec["pages"], n, replace=False))
            dst = tuple(int(x) for x in rng.choice(spec["pages"], n, replace=False))
            before = p.metrics.setup_seconds
            t0 = time.perf_counter()
            p.write(KvWrite(f"{name}-{n}-{r}", r, d_inc, src, dst))
            _wait_done(p)
            hand.append(time.perf_counter() - t0)
            setup.append(p.metrics.setup_seconds - before)
        local = p.agent.get_xfer_descs(np.array([[raw.data_ptr(), nbytes, 0]], dtype=np.uint64),
                                       "DRAM")
        remote = p.agent.get_xfer_descs(np.array([[raw_remote[0], nbytes, 0]], dtype=np.uint64),
                                        "DRAM")
        h = p.agent.initialize_xfer("WRITE", local, remote, d_name, b"raw")
        raws = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            p.agent.transfer(h)
            while p.agent.check_xfer_state(h) == "PROC":
                pass
            raws.append(time.perf_counter() - t0)
        p.agent.release_xfer_handle(h)
        a, b = torch.zeros(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
        a.copy_(b)                       # touch every page before timing
        copies = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            a.copy_(b)
            copies.append(time.perf_counter() - t0)
        med = statistics.median
        rows.append({"pool": name, "pages": n, "mib": nbytes / 2 ** 20,
                     "handoff_gbs": nbytes / med(hand) / 1e9, "raw_gbs": nbytes / med(raws) / 1e9,
                     "memcpy_gbs": nbytes / med(copies) / 1e9, "setup_us": med(setup) * 1e6,
                     "descriptors": p.metrics.descriptors})
    p.close()
    conn.send(("close",))
    conn.recv()
    proc.join(10)
    return rows


def main() -> int:
    rng = np.random.default_rng(0)
    rows = []
    for name, spec in POOLS.items():
        rows += _bench_pool(name, spec, rng)
    print(f"KV handoff between two processes, NIXL over UCX, host memory; median of {REPEATS}")
    print(f"{'pool':<11} {'pages':>5} {'MiB':>8} {'handoff GB/s':>13} {'raw NIXL GB/s':>14} "
          f"{'memcpy GB/s':>12} {'handoff/raw':>12} {'setup µs':>9}")
    for r in rows:
        print(f"{r['pool']:<11} {r['pages']:>5} {r['mib']:>8.2f} {r['handoff_gbs']:>13.2f} "
              f"{r['raw_gbs']:>14.2f} {r['memcpy_gbs']:>12.2f} "
              f"{r['handoff_gbs'] / r['raw_gbs']:>12.2f} {r['setup_us']:>9.0f}")
    last = next(r for r in rows if r["pool"] == "llama-3-8b" and r["pages"] == 128)
    print(f"handoff_vs_raw_nixl={last['handoff_gbs'] / last['raw_gbs']:.2f} at 128 pages")
    return 0
