"""`pdserve bench tp-pd`: one request's KV moved from a prefill engine to a
decode engine of tensor-parallel sizes P TP 1 -> D TP 2, P TP 2 -> D TP 1
and P TP 2 -> D TP 2 (and TP 1 -> TP 1 as the baseline), over NIXL (UCX,
host DRAM), the tiny model (float32), rank to rank as the engines move it
(engine/tp/transfer.py): every rank, worker processes included, its own
agent; each P rank writes each D rank the heads it owns, packing a piece
whose page holds other heads too, and D's ranks unpack theirs.

D runs in a spawned process (each engine is rank 0 of its own process
group, as in a deployment; a TP engine's rank 0 spawns its worker); P in
this one. Per trial P's transport posts the write and polls until DONE (its
every rank's pieces ended); D's polls until LANDED (every D rank has its
pieces, unpacked) and reports when. Times are medians over the trials: P's
write (post -> DONE) and the whole transfer (post -> D's LANDED: what a
request waits before D can decode). Bytes per rank and descriptors are
those of the pieces (transfer/tp/pieces.py): each P rank's sent, each D
rank's received, one descriptor a page a piece.

The staged path this replaced (every byte through both rank 0s) was timed by
this benchmark's first version, before it was deleted; docs/benchmarks.md
has both."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from pdserve.benchmarks.common.options import positive

PAGE = 16
COMBOS = ((1, 1), (1, 2), (2, 1), (2, 2))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive, default=4096,
                   help="the request's prompt: its pages x 16 tokens are moved (4096)")
    p.add_argument("--trials", type=positive, default=20, help="transfers timed per pair (20)")


@dataclass(frozen=True)
class DSideReady:
    """D, to the bench: its transport's metadata, and its incarnation."""
    metadata: bytes
    engine_id: str
    epoch: int


@dataclass(frozen=True)
class DSideLanded:
    """D, to the bench: a write LANDED (every D rank has its pieces), at `done` (perf_counter)."""
    done: float


@dataclass(frozen=True)
class DSideStop:
    """The bench, to D: exit."""


class _Engine:
    """A transport over the KV of one engine of `size` ranks (tiny model,
    random KV), moving it per rank."""

    def __init__(self, name: str, size: int, pages: int):
        import torch

        from pdserve.kernels.models.loader import load_model
        from pdserve.engine.tp.kv_ranks import TpKvRanks
        from pdserve.engine.tp.leader import TpLeader
        from pdserve.engine.tp.worker import TpSpec
        from pdserve.transfer import Incarnation
        from pdserve.transfer.nixl.transport import NixlTransport
        from pdserve.transfer.tp.rank_agent import LocalRanks

        self.leader = None
        if size == 1:
            model, _ = load_model(None, "tiny", dtype="float32", attention="torch")
            caches = model.new_caches([pages], PAGE)
        else:
            self.leader = TpLeader(TpSpec(None, "tiny", "float32", "torch", "cpu", size, 60.0))
            caches = self.leader.new_caches([pages], PAGE)
        caches[0].data.copy_(torch.randn_like(caches[0].data))
        shard = caches[0].data
        self.layout = _layout(size, shard.shape[1], shard.shape[-1])
        self.transport = NixlTransport(Incarnation(name, 1))
        self.transport.register_pools([shard], layout=self.layout)
        agent = self.transport.incarnation.agent_name
        self.transport.use_ranks(LocalRanks(agent, [shard], self.layout) if self.leader is None
                                 else TpKvRanks(self.leader, agent, self.layout))

    def close(self) -> None:
        self.transport.close()
        if self.leader is not None:
            self.leader.close()


def _d_main(size: int, pages: int, conn) -> None:
    """The decode engine's process: report each landing, until stopped."""
    from pdserve.transfer import Incarnation, TransferEventKind

    eng = _Engine("decode-0", size, pages)
    try:
        t = eng.transport
        conn.send(DSideReady(t.metadata(), t.incarnation.engine_id, t.incarnation.epoch))
        inc, md = conn.recv()
        t.add_peer(Incarnation(inc, 1), md)
        while True:
            if conn.poll(0):
                if isinstance(conn.recv(), DSideStop):
                    return
            for ev in t.poll():
                if ev.kind is TransferEventKind.LANDED:
                    conn.send(DSideLanded(time.perf_counter()))
    finally:
        eng.close()


def measure(p_size: int, d_size: int, tokens: int, trials: int) -> dict:
    import torch.multiprocessing as mp

    from pdserve.transfer import Incarnation, KvWrite, TransferEventKind
    from pdserve.transfer.tp.pieces import bytes_per_rank, plan_pieces

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
        write, total = [], []
        for i in range(trials + 3):
            t0 = time.perf_counter()
            p.transport.write(KvWrite(f"bench-{i}", 1, d_inc, src, dst))
            while True:
                evs = p.transport.poll()
                if evs:
                    assert [e.kind for e in evs] == [TransferEventKind.DONE], evs
                    break
            tw = time.perf_counter()
            landed = _recv(mine, proc)
            if i >= 3:
                write.append(tw - t0)
                total.append(landed.done - t0)
        per = lambda xs: statistics.median(xs) * 1e3      # noqa: E731
        d_lay = _layout(d_size, p.layout.layers[0], p.layout.head_dim)
        moved = bytes_per_rank(p.layout, d_lay, [n], 4)
        return {"pages": n, "bytes": n * p.transport.page_bytes * p_size,
                "write_ms": per(write), "total_ms": per(total),
                "descriptors": n * len(plan_pieces(p.layout, d_lay)),
                "p_ranks": list(moved.sent), "d_ranks": list(moved.received)}
    finally:
        mine.send(DSideStop())
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        p.close()


def _layout(size: int, layers: int, head_dim: int):
    from pdserve.transfer.kv_layout import KvLayout

    return KvLayout(size, 2, head_dim, "float32", PAGE, (layers,))


def _recv(conn, proc, bound_s: float = 300.0):
    """D's next message, or a RuntimeError if D died or said nothing in `bound_s`."""
    if not conn.poll(bound_s):
        raise RuntimeError(f"the decode side said nothing in {bound_s:g} s "
                           f"(exit code {proc.exitcode})")
    return conn.recv()


def run(args) -> int:
    n = -(-args.tokens // PAGE)
    print(f"one request's KV, {args.tokens} tokens ({n} pages of {PAGE}), tiny model float32, "
          f"moved rank to rank, median of {args.trials} transfers")
    print(f"{'P TP':>5} {'D TP':>5} {'bytes':>10} {'descriptors':>12} {'P write ms':>11} "
          f"{'transfer ms':>12}  bytes per P rank sent / per D rank received")
    for p_size, d_size in COMBOS:
        m = measure(p_size, d_size, args.tokens, args.trials)
        print(f"{p_size:>5} {d_size:>5} {m['bytes']:>10,} {m['descriptors']:>12,} "
              f"{m['write_ms']:>11.2f} {m['total_ms']:>12.2f}  {m['p_ranks']} / "
              f"{m['d_ranks']}", flush=True)
    return 0
