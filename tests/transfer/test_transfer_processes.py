"""Two processes, real NIXL over UCX on host memory."""

import time

import torch

from pdserve.transfer import Incarnation, KvWrite, TransferEventKind
from pdserve.transfer.nixl.transport import NixlTransport
from pdserve.transfer.nixl.peer_process import make_pool, spawn

SHAPE = (2, 2, 4, 2, 8)
BOUND_S = 10.0                 # every wait below: far past a local write's milliseconds


def recv(conn, seconds: float = BOUND_S):
    """The peer's next reply; fails instead of blocking on a peer that died."""
    assert conn.poll(seconds), f"the peer process sent nothing within {seconds} s"
    return conn.recv()


def test_a_scattered_multi_page_write_lands_bit_exact_in_another_process():
    proc, conn, md, _ = spawn("decode-0", 1, 64, SHAPE)
    try:
        p = NixlTransport(Incarnation("prefill-0", 1), telemetry=True)
        src_pool = make_pool(64, SHAPE, torch.float32)
        p.register_pool(src_pool)
        d_inc = Incarnation("decode-0", 1)
        p.add_peer(d_inc, md)
        conn.send((p.incarnation, p.metadata()))
        src = (0, 1, 2, 3, 17, 40, 41, 63)          # a run, singles, a partial run
        dst = (10, 11, 12, 13, 2, 50, 51, 0)
        p.write(KvWrite("req-7", 3, d_inc, src, dst))
        done = []
        deadline = time.monotonic() + BOUND_S
        while not done and time.monotonic() < deadline:
            done = p.poll()
        assert [(e.kind, e.req_id) for e in done] == [(TransferEventKind.DONE, "req-7")]
        conn.send(("wait", 1, BOUND_S))
        events = recv(conn, BOUND_S + 5)
        assert events == [(TransferEventKind.LANDED, "req-7", 3, "prefill-0@1")]
        conn.send(("read", dst))
        got = recv(conn)
        assert torch.equal(got, src_pool[list(src)])
        conn.send(("read", (1, 3, 49)))             # pages nobody wrote
        assert torch.all(recv(conn) == -1)
        # NIXL's own count of what it moved: 0-3, 17, 40-41, 63
        assert p.metrics.backend_descriptors == 4
        p.close()
    finally:
        conn.send(("close",))
        conn.poll(BOUND_S)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
