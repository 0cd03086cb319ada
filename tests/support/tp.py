"""Helpers for tensor-parallel tests: ranks as spawned processes on gloo,
and a greedy run over a paged cache driven straight through a model's
forward (no planner), the same on TP 1 and on every rank of TP N."""

from __future__ import annotations

import socket
import traceback

import torch
import torch.multiprocessing as mp

from pdserve.kernels.attention import BatchMeta, SeqMeta

PS = 4
PAGES = 16              # per sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(model, prompts: list[list[int]], steps: int, caches=None) -> tuple[list, list]:
    """(logits of every round, float32, [rows, vocab]; the greedy tokens of
    each prompt): the prompts prefilled in one round, then decoded together.
    `caches`: the model's caches to write (default: new ones)."""
    groups = model.groups
    if caches is None:
        caches = model.new_caches([PAGES * len(prompts)] * len(groups), PS)
    tables = [list(range(i * PAGES, (i + 1) * PAGES)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    out: list = []

    def run(rows: list[tuple[int, int, int]]):       # (sequence, first position, count)
        ids, pos, slot, metas_seqs, last = [], [], [], [], []
        for s, begin, n in rows:
            q0 = len(ids)
            ids += seqs[s][begin:begin + n]
            pos += range(begin, begin + n)
            slot += [tables[s][p // PS] * PS + p % PS for p in range(begin, begin + n)]
            metas_seqs.append(SeqMeta(q0, n, begin + n, tables[s], 0))
            last.append(len(ids) - 1)
        decodes = sum(1 for _, _, n in rows if n == 1)
        metas = [BatchMeta(metas_seqs, torch.tensor(slot), torch.tensor(pos),
                           num_decodes=decodes, window=g.window if g.sliding else None)
                 for g in groups]
        return model.forward(torch.tensor(ids), metas, caches, torch.tensor(last))

    logits = run([(i, 0, len(p)) for i, p in enumerate(prompts)])
    for _ in range(steps):
        out.append(logits)
        for s, tok in enumerate(logits.argmax(-1).tolist()):
            seqs[s].append(tok)
        logits = run([(s, len(seqs[s]) - 1, 1) for s in range(len(prompts))])
    out.append(logits)
    return out, [s[len(p):] for s, p in zip(seqs, prompts)]


def _rank_main(rank: int, size: int, port: int, fn, args, results) -> None:
    from pdserve.kernels.tensor_parallel import TpComm

    try:
        comm = TpComm(rank, size, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60.0)
        value = fn(comm, *args)
        comm.close()
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, size: int, *args, timeout_s: float = 120.0):
    """`fn(comm, *args)` on `size` spawned ranks; rank 0's value (an error
    on any rank fails with its traceback)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, fn, args, results),
                         daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(size):
            rank, status, value = results.get(timeout=timeout_s)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return got[0]
