"""Two processes, real NIXL over UCX on host memory."""

import torch

from pdserve.transfer import Incarnation, KvWrite
from pdserve.transfer.nixl_transport import NixlTransport
from pdserve.transfer.peer_process import make_pool, spawn

SHAPE = (2, 2, 4, 2, 8)


def test_a_scattered_multi_page_write_lands_bit_exact_in_another_process():
    proc, conn, md, _ = spawn("decode-0", 1, 64, SHAPE)
    try:
        p = NixlTransport(Incarnation("prefill-0", 1))
        src_pool = make_pool(64, SHAPE, torch.float32)
        p.register_pool(src_pool)
        d_inc = Incarnation("decode-0", 1)
        p.add_peer(d_inc, md)
        conn.send((p.incarnation, p.metadata()))
        src = (0, 1, 2, 3, 17, 40, 41, 63)          # a run, singles, a partial run
        dst = (10, 11, 12, 13, 2, 50, 51, 0)
        p.write(KvWrite("req-7", 3, d_inc, src, dst))
        done = []
        while not done:
            done = p.poll()
        assert [(e.kind, e.req_id) for e in done] == [("done", "req-7")]
        conn.send(("wait", 1, 10.0))
        events = conn.recv()
        assert events == [("landed", "req-7", 3, "prefill-0@1")]
        conn.send(("read", dst))
        got = conn.recv()
        assert torch.equal(got, src_pool[list(src)])
        conn.send(("read", (1, 3, 49)))             # pages nobody wrote
        assert torch.all(conn.recv() == -1)
        assert p.metrics.descriptors == 4            # 0-3, 17, 40-41, 63
        p.close()
    finally:
        conn.send(("close",))
        conn.recv()
        proc.join(10)
