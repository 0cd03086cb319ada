"""A NIXL peer in its own process, driven over a pipe: the other end of
two-process tests and of `pdserve bench transfer`.

    parent                          child (serve)
    spawn(...) ----------------->   register a pool, send metadata
    send((incarnation, metadata))   add the parent as a peer
    send(("wait", n, seconds))      poll until n landings -> send events
    send(("read", pages))           send those pages' bytes
    send(("close",))                exit
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from pdserve.transfer.transport import Incarnation, TransferEventKind


def make_pool(pages: int, page_shape, dtype, fill=None, device="cpu") -> torch.Tensor:
    """A page-major pool on `device` (a CUDA pool registers as NIXL VRAM)."""
    if fill is None:
        n = pages * int(torch.tensor(page_shape).prod())
        return torch.arange(n, dtype=torch.float32).remainder(65521).to(dtype).view(
            pages, *page_shape).to(device)
    return torch.full((pages, *page_shape), fill, dtype=dtype, device=device)


def serve(conn, engine_id: str, epoch: int, pages: int, page_shape, dtype_name: str,
          raw_bytes: int = 0, device: str = "cpu") -> None:
    from pdserve.transfer.nixl.transport import NixlTransport

    t = NixlTransport(Incarnation(engine_id, epoch))
    pool = make_pool(pages, page_shape, getattr(torch, dtype_name), fill=-1, device=device)
    t.register_pool(pool)
    raw = None
    if raw_bytes:                       # one contiguous buffer for the raw-NIXL baseline
        raw = torch.zeros(raw_bytes, dtype=torch.uint8, device=device)
        t.agent.register_memory(raw)
    conn.send((t.metadata(), (raw.data_ptr(), raw_bytes) if raw is not None else None))
    peer, md = conn.recv()
    t.add_peer(peer, md)
    events = []
    while True:
        if not conn.poll(0.0005):
            events += t.poll()
            continue
        cmd = conn.recv()
        if cmd[0] == "wait":
            n, deadline = cmd[1], time.monotonic() + cmd[2]
            while len([e for e in events if e.kind is TransferEventKind.LANDED]) < n and \
                    time.monotonic() < deadline:
                events += t.poll()
            conn.send([(e.kind, e.req_id, e.epoch, e.peer.agent_name) for e in events])
            events = []
        elif cmd[0] == "wait_raw":
            deadline = time.monotonic() + cmd[1]
            got = False
            while not got and time.monotonic() < deadline:
                got = any(cmd[2] in m for ms in t.agent.get_new_notifs().values() for m in ms)
            conn.send(got)
        elif cmd[0] == "read":
            conn.send(pool[list(cmd[1])].cpu())
        elif cmd[0] == "close":
            t.close()
            conn.send("closed")
            return


def spawn(engine_id: str, epoch: int, pages: int, page_shape, dtype_name="float32",
          raw_bytes: int = 0, device: str = "cpu"):
    """Start a peer process, its pool and raw buffer on `device` (cpu, or
    cuda: NIXL VRAM); returns (process, connection, its metadata, and
    (address, bytes) of its raw buffer or None)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child, engine_id, epoch, pages, tuple(page_shape),
                                           dtype_name, raw_bytes, device), daemon=True)
    proc.start()
    md, raw_desc = parent.recv()
    return proc, parent, md, raw_desc
