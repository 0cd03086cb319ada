"""`pdserve bench tp-pd`: one request's KV moved from a prefill engine to a
decode engine of tensor-parallel sizes P TP 1 -> D TP 2, P TP 2 -> D TP 1
and P TP 2 -> D TP 2 (and TP 1 -> TP 1 as the baseline), over NIXL (UCX,
host DRAM), the tiny model (float32), as the engines move it today: staged
through rank 0 (roles/tp_staging.py: P's ranks gather their heads to P's
rank 0, one whole-page write rank 0 to rank 0, D's rank 0 scatters each rank
its heads).

D runs in a spawned process (each engine is rank 0 of its own process
group, as in a deployment); P in this one. Per trial: P posts the write
(the gather runs there), polls until DONE; D polls until the notification
lands and scatters (`KvTransport.landed`), then reports when it finished.
Times are medians over the trials: gather (P, at the post), P's write
(post -> DONE, the gather included), and the whole transfer (post -> D's
scatter done: what a request waits before D can decode). Bytes per rank
are counted by the staging (TpStaging.bytes): what each rank sent to, or
received from, its rank 0."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from pdserve.benchmarks.args import positive

PAGE = 16
COMBOS = ((1, 1), (1, 2), (2, 1), (2, 2))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive, default=4096,
                   help="the request's prompt: its pages x 16 tokens are moved (4096)")
    p.add_argument("--trials", type=positive, default=20, help="transfers timed per pair (20)")
    p.add_argument("--path", choices=("staged", "per-rank", "both"), default="both",
                   help="staged through rank 0 (the engines' path today), per-rank (one "
                        "NIXL agent per rank, each D rank written its heads by the P ranks "
                        "holding them; the ranks' agents in one process per engine), or both")


@dataclass(frozen=True)
class DSideReady:
    """D, to the bench: its transport's metadata, and its incarnation."""
    metadata: bytes
    engine_id: str
    epoch: int


@dataclass(frozen=True)
class DSideLanded:
    """D, to the bench: a write landed and was scattered, at `done` (perf_counter)."""
    done: float
    scatter_s: float
    scattered: tuple            # bytes each of D's ranks received so far


@dataclass(frozen=True)
class DSideStop:
    """The bench, to D: exit."""


class _Engine:
    """A transport over the KV pools of one engine of `size` ranks, tiny model."""

    def __init__(self, name: str, size: int, pages: int):
        import torch

        from pdserve.kernels.loader import load_model
        from pdserve.roles.tp_leader import TpLeader
        from pdserve.roles.tp_staging import TpStaging
        from pdserve.roles.tp_worker import TpSpec
        from pdserve.transfer import Incarnation
        from pdserve.transfer.kv_layout import KvLayout
        from pdserve.transfer.nixl_transport import NixlTransport

        self.leader = None
        self.staging = None
        if size == 1:
            model, _ = load_model(None, "tiny", dtype="float32", attention="torch")
            caches = model.new_caches([pages], PAGE)
            caches[0].data.copy_(torch.randn_like(caches[0].data))
            pools = [caches[0].data]
        else:
            self.leader = TpLeader(TpSpec(None, "tiny", "float32", "torch", "cpu", size, 60.0))
            caches = self.leader.new_caches([pages], PAGE)
            caches[0].data.copy_(torch.randn_like(caches[0].data))
            self.staging = TpStaging(self.leader, PAGE)
            pools = [p.data for p in self.staging.pools]
        shard = caches[0].data
        self.layout = KvLayout(size, 2, shard.shape[-1], "float32", PAGE, (shard.shape[1],))
        self.transport = NixlTransport(Incarnation(name, 1))
        self.transport.register_pools(pools, layout=self.layout, staging=self.staging)

    def close(self) -> None:
        self.transport.close()
        if self.leader is not None:
            self.leader.close()


def _d_main(size: int, pages: int, conn) -> None:
    """The decode engine's process: land, scatter, report, until stopped."""
    from pdserve.transfer import Incarnation, TransferEventKind

    eng = _Engine("decode-0", size, pages)
    try:
        t = eng.transport
        conn.send(DSideReady(t.metadata(), t.incarnation.engine_id, t.incarnation.epoch))
        inc, md = conn.recv()
        t.add_peer(Incarnation(inc, 1), md)
        dst = tuple(range(pages // 2, pages // 2 + pages // 4))
        while True:
            if conn.poll(0):
                if isinstance(conn.recv(), DSideStop):
                    return
            for ev in t.poll():
                if ev.kind is TransferEventKind.LANDED:
                    t0 = time.perf_counter()
                    t.landed(dst)
                    done = time.perf_counter()
                    got = tuple(eng.staging.bytes.scattered) if eng.staging else (0,)
                    conn.send(DSideLanded(done, done - t0, got))
    finally:
        eng.close()


def measure(p_size: int, d_size: int, tokens: int, trials: int) -> dict:
    import torch.multiprocessing as mp

    from pdserve.transfer import Incarnation, KvWrite, TransferEventKind

    n = -(-tokens // PAGE)
    pages = 4 * n                   # D lands in [pages/2, pages/2 + n)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    # not daemonic: a TP D spawns its own worker ranks
    proc = ctx.Process(target=_d_main, args=(d_size, pages, theirs))
    proc.start()
    p = _Engine("prefill-0", p_size, pages)
    try:
        ready = _recv(mine, proc)
        d_inc = Incarnation(ready.engine_id, ready.epoch)
        p.transport.add_peer(d_inc, ready.metadata)
        mine.send((p.transport.incarnation.engine_id, p.transport.metadata()))
        src = tuple(range(n))
        dst = tuple(range(pages // 2, pages // 2 + n))
        gather, write, total, scatter = [], [], [], []
        landed = DSideLanded(0.0, 0.0, ())
        for i in range(trials + 3):
            t0 = time.perf_counter()
            if p.staging is not None:
                p.staging.gather(p.transport, src)
            tg = time.perf_counter()
            p.transport._post(KvWrite("bench", i + 1, d_inc, src, dst))
            while True:
                evs = p.transport.poll()
                if evs:
                    assert [e.kind for e in evs] == [TransferEventKind.DONE], evs
                    break
            tw = time.perf_counter()
            landed = _recv(mine, proc)
            if i >= 3:
                gather.append(tg - t0)
                write.append(tw - t0)
                total.append(landed.done - t0)
                scatter.append(landed.scatter_s)
        per = lambda xs: statistics.median(xs) * 1e3      # noqa: E731
        runs = trials + 3
        sent = [b // runs for b in p.staging.bytes.gathered] if p.staging else [0]
        received = [b // runs for b in landed.scattered]
        return {"pages": n, "bytes": p.transport.bytes_of(src), "gather_ms": per(gather),
                "write_ms": per(write), "scatter_ms": per(scatter), "total_ms": per(total),
                "p_ranks": sent, "d_ranks": received}
    finally:
        mine.send(DSideStop())
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        p.close()


@dataclass(frozen=True)
class DRanksReady:
    """D (per-rank), to the bench: every D rank's agent meta."""
    metas: tuple


@dataclass(frozen=True)
class DRanksLanded:
    """D (per-rank), to the bench: every piece's notification reached its D rank."""
    done: float


def _layout(size: int, layers: int, head_dim: int):
    from pdserve.transfer.kv_layout import KvLayout

    return KvLayout(size, 2, head_dim, "float32", PAGE, (layers,))


def _shards(size: int, pages: int, random: bool) -> list:
    """Each rank's page-major shard of the tiny model's KV (2 layers, 2 KV heads x 16)."""
    import torch

    from pdserve.transfer.tp_pieces import heads_of

    lay = _layout(size, 2, 16)
    make = torch.randn if random else torch.zeros
    return [make(pages, 2, 2, PAGE, len(heads_of(lay, r)), 16) for r in range(size)]


def _d_ranks_main(p_size: int, d_size: int, pages: int, conn) -> None:
    """The decode engine's ranks (per-rank): report when every D rank has a
write's pieces (and unpacked them)."""
    from pdserve.transfer.rank_agent import KvRankAgent

    d_lay = _layout(d_size, 2, 16)
    agents = [KvRankAgent(f"decode-0@1#{r}", r, [s], d_lay)
              for r, s in enumerate(_shards(d_size, pages, False))]
    want = d_size                   # each D rank reports a write once, all its pieces landed
    try:
        conn.send(DRanksReady(tuple(a.meta() for a in agents)))
        p_metas = conn.recv()
        for a in agents:
            a.accept("prefill-0", _layout(p_size, 2, 16), list(p_metas))
        got = 0
        while True:
            if conn.poll(0) and isinstance(conn.recv(), DSideStop):
                return
            for a in agents:
                got += len(a.poll()[1])
            if got >= want:
                conn.send(DRanksLanded(time.perf_counter()))
                got -= want
    finally:
        for a in agents:
            a.close()


def measure_per_rank(p_size: int, d_size: int, tokens: int, trials: int) -> dict:
    import torch.multiprocessing as mp

    from pdserve.transfer.rank_agent import KvRankAgent
    from pdserve.transfer.tp_pieces import bytes_per_rank

    n = -(-tokens // PAGE)
    pages = 4 * n
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_d_ranks_main, args=(p_size, d_size, pages, theirs), daemon=True)
    proc.start()
    p_lay, d_lay = _layout(p_size, 2, 16), _layout(d_size, 2, 16)
    agents = [KvRankAgent(f"prefill-0@1#{r}", r, [s], p_lay)
              for r, s in enumerate(_shards(p_size, pages, True))]
    try:
        metas = list(_recv(mine, proc).metas)
        mine.send(tuple(a.meta() for a in agents))
        for a in agents:
            a.connect("decode-0", d_lay, metas)
        src, dst = [list(range(n))], [list(range(pages // 2, pages // 2 + n))]
        write, total = [], []
        for i in range(trials + 3):
            t0 = time.perf_counter()
            for a in agents:
                assert a.post("decode-0", f"bench-{i}", src, dst, b"bench") == []
            left = sum(len(a._routes["decode-0"]) for a in agents)
            while left:
                for a in agents:
                    ends = a.poll()[0]
                    assert all(e.ok for e in ends), ends
                    left -= len(ends)
            tw = time.perf_counter()
            landed = _recv(mine, proc)
            if i >= 3:
                write.append(tw - t0)
                total.append(landed.done - t0)
        per = lambda xs: statistics.median(xs) * 1e3      # noqa: E731
        moved = bytes_per_rank(p_lay, d_lay, [n], 4)
        return {"pages": n, "write_ms": per(write), "total_ms": per(total),
                "p_ranks": list(moved.sent), "d_ranks": list(moved.received),
                "descriptors": sum(a.descriptors for a in agents) // (trials + 3)}
    finally:
        mine.send(DSideStop())
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        for a in agents:
            a.close()


def _recv(conn, proc, bound_s: float = 300.0):
    """D's next message, or a RuntimeError if D died or said nothing in `bound_s`."""
    if not conn.poll(bound_s):
        raise RuntimeError(f"the decode side said nothing in {bound_s:g} s "
                           f"(exit code {proc.exitcode})")
    return conn.recv()


def run(args) -> int:
    n = -(-args.tokens // PAGE)
    print(f"one request's KV, {args.tokens} tokens ({n} pages of {PAGE}), tiny model float32, "
          f"median of {args.trials} transfers")
    if args.path in ("staged", "both"):
        print("staged through rank 0 (P's ranks gather to rank 0, one whole-page write, D's "
              "rank 0 scatters)")
        print(f"{'P TP':>5} {'D TP':>5} {'bytes':>10} {'gather ms':>10} {'P write ms':>11} "
              f"{'scatter ms':>11} {'transfer ms':>12}  bytes per P rank -> rank 0 / "
              "per D rank <- rank 0")
        for p_size, d_size in COMBOS:
            m = measure(p_size, d_size, args.tokens, args.trials)
            print(f"{p_size:>5} {d_size:>5} {m['bytes']:>10,} {m['gather_ms']:>10.2f} "
                  f"{m['write_ms']:>11.2f} {m['scatter_ms']:>11.2f} {m['total_ms']:>12.2f}  "
                  f"{m['p_ranks']} / {m['d_ranks']}", flush=True)
    if args.path in ("per-rank", "both"):
        print("per-rank (each P rank writes the D ranks its heads; one agent per rank)")
        print(f"{'P TP':>5} {'D TP':>5} {'descriptors':>12} {'P write ms':>11} "
              f"{'transfer ms':>12}  bytes per P rank sent / per D rank received")
        for p_size, d_size in COMBOS:
            m = measure_per_rank(p_size, d_size, args.tokens, args.trials)
            print(f"{p_size:>5} {d_size:>5} {m['descriptors']:>12,} {m['write_ms']:>11.2f} "
                  f"{m['total_ms']:>12.2f}  {m['p_ranks']} / {m['d_ranks']}", flush=True)
    return 0
