"""A rank > 0 of a tensor-parallel engine: a process rank 0 spawned on its
node. It joins the process group, loads its shard, says it is ready, then
does what rank 0's messages (tp_messages.py) say, in order, until the stop
or until rank 0 is gone (its pipe closes): allocate the caches, run each
round's forward on its shard (the collectives meet rank 0's), compare
digests when asked. It decides nothing: no planner, no clock, no peer."""

from __future__ import annotations

import logging
import os
import pickle
import traceback
from dataclasses import dataclass

import torch

from pdserve.kernels.tensor_parallel import TpComm, TpLost
from pdserve.engine.tp.kv_ranks import TP_KV_MESSAGES, serve_kv
from pdserve.engine.tp.messages import (
    TpCaches, TpForward, TpPageMove, TpPageMoveKind, TpReady, TpStarted, TpStop, digest)

log = logging.getLogger("pdserve.tp")


@dataclass(frozen=True)
class TpSpec:
    """What every rank loads, and how the group meets."""
    path: str | None
    preset: str | None
    dtype: str
    attention: str
    device: str                 # cpu, or cuda: rank r runs on cuda:r of what it sees
    size: int
    timeout_s: float            # every collective's bound (engine.tensor_parallel_timeout_s)
    check: bool = False         # compare digests every round (engine.tensor_parallel_check)
    expert_parallel: bool = False   # a MoE's experts sharded whole (model.expert_parallel)

    def share_cpu(self) -> None:
        """On CPU, each rank takes its share of the cores' threads: T ranks of
        the machine's intra-op threads each spin-wait on the same cores, and
        a rank waiting in a collective then waits on its peers' spinning
        (tiny model, 2 cores: 130 ms a token at TP 2, 17 ms once shared)."""
        if not self.device.startswith("cuda"):
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // self.size))

    def rank_device(self, rank: int) -> torch.device:
        return torch.device(f"cuda:{rank}") if self.device.startswith("cuda") \
            else torch.device("cpu")


def worker_main(spec: TpSpec, rank: int, init_method: str, conn) -> None:
    """The process's body (a spawn target)."""
    from pdserve.kernels.models.loader import load_model

    conn.send(TpStarted(rank))

    device = spec.rank_device(rank)
    spec.share_cpu()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        comm = TpComm(rank, spec.size, init_method, device, spec.timeout_s)
        model, _ = load_model(spec.path, spec.preset, dtype=spec.dtype, device=device,
                              attention=spec.attention, tp=comm,
                              expert_parallel=spec.expert_parallel)
    except Exception as e:
        conn.send(TpReady(rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn.send(TpReady(rank))
    try:
        _serve(model, comm, conn, device)
    except (EOFError, OSError):
        log.info("tp rank %d: rank 0 is gone; exiting", rank)
    except TpLost as e:
        log.error("tp rank %d: %s", rank, e)
        raise SystemExit(3) from e
    finally:
        comm.close()


def _serve(model, comm: TpComm, conn, device: torch.device) -> None:
    agents: dict = {}               # per-rank KV transfer agents, by name (tp_kv_ranks.py)
    try:
        _serve_messages(model, comm, conn, device, agents)
    finally:
        for agent in agents.values():
            agent.close()


def _serve_messages(model, comm: TpComm, conn, device: torch.device, agents: dict) -> None:
    caches = None
    while True:
        payload = conn.recv_bytes()
        msg = pickle.loads(payload)
        if isinstance(msg, TpStop):
            return
        if isinstance(msg, TpCaches):
            caches = model.new_caches(list(msg.pages), msg.page_size)
        elif isinstance(msg, TpForward):
            if caches is None:
                raise RuntimeError("a forward before the caches were allocated")
            ids, metas, rows = msg.inputs(device)
            model.forward(ids, metas, caches, rows)
            if msg.check:
                compare_views(comm, msg.round, payload)
        elif isinstance(msg, TpPageMove):
            if caches is None:
                raise RuntimeError("a page move before the caches were allocated")
            move_pages(comm, caches[msg.group].data, msg)
        elif isinstance(msg, TP_KV_MESSAGES):
            if caches is None:
                raise RuntimeError("a KV transfer message before the caches were allocated")
            serve_kv(msg, comm.rank, caches, agents, conn)
        else:
            raise TypeError(f"rank {comm.rank}: unknown message {type(msg).__name__}")


def move_pages(comm: TpComm, kv: torch.Tensor, msg: TpPageMove):
    """This rank's side of a gather over its cache tensor `kv`: it sends its
    heads of the pages (rank 0 gets every rank's, in rank order)."""
    if msg.kind is not TpPageMoveKind.GATHER:
        raise TypeError(f"rank {comm.rank}: unknown page move {msg.kind}")
    idx = torch.from_numpy(msg.pages).to(kv.device)
    return comm.gather(kv.index_select(0, idx))


class TpDivergence(TpLost):
    """The ranks' views of a round differ (engine.tensor_parallel_check)."""


def compare_views(comm: TpComm, round_: int, payload: bytes) -> None:
    """Every rank's (round, digest of its message) gathered and compared:
    a rank whose view differs from rank 0's fails every rank, loudly."""
    mine = torch.tensor([round_, digest(payload)], dtype=torch.int64)
    views = comm.all_gather(mine, group=comm.cpu_group)
    bad = [r for r, v in enumerate(views) if not torch.equal(v, views[0])]
    if bad:
        seen = ", ".join(f"rank {r}: round {int(v[0])} digest {int(v[1]):#x}"
                         for r, v in enumerate(views))
        raise TpDivergence(f"tensor-parallel ranks {bad} diverge from rank 0 at round "
                           f"{int(views[0][0])} ({seen})")
