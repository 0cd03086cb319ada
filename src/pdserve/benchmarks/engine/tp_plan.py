"""`pdserve bench tp-plan`: what sharing a round with the other ranks of a
tensor-parallel engine costs, at 1, 64 and 256 running requests.

Every request decodes (one row each) over a context of `--context` tokens,
so each block table holds context / page_size pages: the round is what the
executor's staging hands `TpLeader.forward`. Rank 0's part is made of the
message (TpForward.of: the tensors and block tables to flat arrays), its
pickle and one pipe write (handed to a sender thread past 32 KiB, as
TpLeader does); a spawned process (a stand-in for rank 1, with
no model) reads it, unpickles it and rebuilds the forward's inputs
(TpForward.inputs), then answers with one byte. The round trip is the
latency a worker's forward starts behind rank 0's; rank 0 itself pays only
the make and send columns (it runs its own shard while the worker decodes).
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import struct
import time

from pdserve.benchmarks.common.decode_inputs import decode_meta
from pdserve.benchmarks.common.options import positive

PAGE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=positive, nargs="+", default=[1, 64, 256],
                   help="running requests, one row each (1 64 256)")
    p.add_argument("--context", type=positive, default=1024,
                   help="tokens each request attends over: its table's pages x 16 (1024)")
    p.add_argument("--rounds", type=positive, default=300, help="rounds timed per size (300)")
    p.add_argument("--engines", action="store_true",
                   help="also TP 1 against TP 2 side by side: pdserve.LLM on the tiny model "
                        "(float32, torch attention), one request's inter-token latency and "
                        "16 requests' tokens/s")


def engines(sizes=(1, 2), decode: int = 64, batch: int = 16) -> None:
    """Each size's LLM in turn, in this process (rank 0) and its workers."""
    from pdserve import LLM, SamplingParams

    prompts = [[(7 * i + j) % 90 + 1 for j in range(64)] for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True)
    print(f"\n{'TP':>3} {'ITL ms (1 request)':>19} {f'tokens/s ({batch} requests)':>24}")
    for t in sizes:
        llm = LLM(dtype="float32", attention="torch", tensor_parallel_size=t)
        try:
            llm.generate(prompts[:2], sp, use_tqdm=False)          # warm
            t0 = time.perf_counter()
            llm.generate(prompts[:1], sp, use_tqdm=False)
            itl = (time.perf_counter() - t0) / decode
            t0 = time.perf_counter()
            out = llm.generate(prompts, sp, use_tqdm=False)
            tps = sum(len(o.token_ids) for o in out) / (time.perf_counter() - t0)
        finally:
            llm.close()
        print(f"{t:>3} {itl * 1e3:>19.2f} {tps:>24.0f}", flush=True)


def decode_round(n: int, context: int) -> tuple:
    """(ids, metas, logits rows): `n` decodes as the executor stages them,
    each attending over `context` tokens, its own among them."""
    import torch

    ids, meta = decode_meta(n, context - 1, PAGE)
    return ids, [meta], torch.arange(n)


def _rank1(conn) -> None:
    """The stand-in worker: decode each round, answer with its decode time."""
    import torch

    while True:
        payload = conn.recv_bytes()
        if not payload:
            return
        t0 = time.perf_counter()
        pickle.loads(payload).inputs(torch.device("cpu"))
        conn.send_bytes(struct.pack("d", time.perf_counter() - t0))


def measure(n: int, context: int, rounds: int, conn) -> dict:
    """Rank 0's side as TpLeader sends: a round over IN_PLACE_BYTES is
    handed to the sender thread (send: the hand-off; rank 0 runs its own
    shard while the thread writes, so the write is in the round trip)."""
    import concurrent.futures as cf

    from pdserve.engine.tp.leader import IN_PLACE_BYTES
    from pdserve.engine.tp.messages import TpForward

    sender = cf.ThreadPoolExecutor(1)

    ids, metas, rows = decode_round(n, context)
    make, send, trip, decode = [], [], [], []
    size = 0
    for r in range(rounds + 20):
        t0 = time.perf_counter()
        payload = pickle.dumps(TpForward.of(r, ids, metas, rows), protocol=pickle.HIGHEST_PROTOCOL)
        t1 = time.perf_counter()
        pending = None
        if len(payload) <= IN_PLACE_BYTES:
            conn.send_bytes(payload)
        else:
            pending = sender.submit(conn.send_bytes, payload)
        t2 = time.perf_counter()
        (dt,) = struct.unpack("d", conn.recv_bytes())
        t3 = time.perf_counter()
        if pending is not None:
            pending.result()
        if r >= 20:                      # warm
            make.append(t1 - t0)
            send.append(t2 - t1)
            trip.append(t3 - t0)
            decode.append(dt)
            size = len(payload)
    sender.shutdown()
    us = lambda xs: statistics.median(xs) * 1e6     # noqa: E731
    return {"requests": n, "bytes": size, "make_us": us(make), "send_us": us(send),
            "decode_us": us(decode), "trip_us": us(trip)}


def run(args) -> int:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_rank1, args=(theirs,), daemon=True)
    proc.start()
    try:
        print(f"sharing a decode round with one other rank, context {args.context} tokens "
              f"({-(-args.context // PAGE)} pages a table), median of {args.rounds} rounds")
        print(f"{'requests':>9} {'bytes':>9} {'make µs':>9} {'send µs':>9} "
              f"{'rank 1 decode µs':>17} {'round trip µs':>14} {'trip µs/req':>12}")
        for n in args.requests:
            m = measure(n, args.context, args.rounds, mine)
            print(f"{n:>9} {m['bytes']:>9,} {m['make_us']:>9.1f} {m['send_us']:>9.1f} "
                  f"{m['decode_us']:>17.1f} {m['trip_us']:>14.1f} "
                  f"{m['trip_us'] / n:>12.2f}")
    finally:
        mine.send_bytes(b"")
        proc.join(10)
    if args.engines:
        engines()
    return 0
