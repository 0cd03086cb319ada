"""Rank 0 of a tensor-parallel engine: the model its executor drives.

An engine of tensor_parallel_size T is its own process (rank 0: the
planner, the executor, the peers, the router's streams) and T - 1 worker
processes it spawns on its node (tp_worker.py), like vLLM's multiprocessing
executor: Ray reserves the engine's T GPUs for the one actor, and the
workers see them as it does. Rank 0 keeps the one planner; each round the
executor stages its forward as usual, and `TpLeader.forward` sends that
forward (tp_messages.TpForward: the plan as the forward needs it) to every
worker before running its own shard; the shards meet in the forward's
collectives, and every rank ends with the whole logits, which only rank 0
samples.

A rank that dies or stops takes the engine down: a worker found exited,
a pipe that breaks, or a collective that fails or passes its timeout
raises TpLost, which `on_lost` hears first (a served engine exits its
process there, so Ray restarts it whole and the router resubmits its
requests); after it every forward raises at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import pickle
import socket
import threading

import numpy as np

import torch
import torch.multiprocessing as mp

from pdserve.kernels.models.model_config import ModelError
from pdserve.kernels.tensor_parallel import TpComm, TpError, TpLost
from pdserve.engine.tp.messages import (
    TpCaches, TpForward, TpPageMove, TpPageMoveKind, TpReady, TpStarted, TpStop)
from pdserve.engine.tp.main_module import check_main_module, exited_before_start
from pdserve.engine.tp.worker import TpSpec, compare_views, move_pages, worker_main

log = logging.getLogger("pdserve.tp")

READY_S = 600.0         # a worker's load (torch's import, the checkpoint) may be slow
IN_PLACE_BYTES = 32 << 10   # a message this small fits an empty pipe (64 KiB): written in place


def _raise(e: TpLost) -> None:
    raise e


class TpLeader:
    """Rank 0's shard behind the model interface the executor uses."""

    tensor_parallel = True      # what choose_capture reads: rounds are sent, not captured

    def __init__(self, spec: TpSpec, on_lost=_raise):
        from pdserve.kernels.models.loader import load_model

        if spec.size < 2:
            raise TpError(f"a TpLeader needs tensor_parallel_size >= 2, got {spec.size}")
        self.spec = spec
        self.on_lost = on_lost
        self.lost: TpLost | None = None
        self.round = 0
        self._sender: cf.ThreadPoolExecutor | None = None    # large messages' writer
        # a message and the collectives it starts go as one: the forward (on
        # the executor's thread under engine.overlap) and a P/D page move (on
        # the loop thread) reach the workers in the order they meet rank 0
        self._turn = threading.Lock()
        self.caches: list = []
        init = f"tcp://127.0.0.1:{_free_port()}"
        spec.share_cpu()            # before the workers start: they inherit the count
        check_main_module(spec.size)    # a script from stdin: said here, not in each rank
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, spec.size):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, rank, init, theirs),
                               daemon=True, name=f"pdserve-tp-rank{rank}")
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        try:
            # a rank that died re-running the program (a script without the
            # main guard) would leave rank 0 waiting in the group for minutes
            self._await_started()
            device = spec.rank_device(0)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self.comm = TpComm(0, spec.size, init, device, spec.timeout_s)
            self.model, self.tokenizer = load_model(
                spec.path, spec.preset, dtype=spec.dtype, device=device,
                attention=spec.attention, tp=self.comm, expert_parallel=spec.expert_parallel)
            self._await_ready()
        except BaseException:
            self._kill()
            raise
        log.info("tensor-parallel engine: %d ranks (pids %s), collectives bounded by %g s",
                 spec.size, [p.pid for p in self.procs], spec.timeout_s)

    def _await_started(self) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if not conn.poll(READY_S):
                raise TpError(f"tensor-parallel rank {rank} did not start in {READY_S:g} s")
            try:
                started = conn.recv()
            except EOFError:            # it exited: its pipe closed unwritten
                proc.join(5)
                raise exited_before_start(rank, proc.pid, proc.exitcode) from None
            assert isinstance(started, TpStarted)

    def _await_ready(self) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if not conn.poll(READY_S):
                raise TpError(f"tensor-parallel rank {rank} did not load its shard in "
                              f"{READY_S:g} s")
            try:
                ready = conn.recv()
            except EOFError:
                proc.join(5)
                raise TpError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                              f"{proc.exitcode} while loading its shard") from None
            assert isinstance(ready, TpReady)
            if ready.error is not None:
                raise TpError(f"tensor-parallel rank {rank} failed to start: {ready.error}")

    # ---- the model interface the executor uses ----------------------------------------
    @property
    def cfg(self):
        return self.model.cfg           # the shard's: its heads, the whole vocabulary

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def attention(self):
        return self.model.attention

    @property
    def groups(self) -> list:
        return self.model.groups

    @property
    def lora(self):
        return None

    def cache_groups(self, replayable: bool = False) -> list:
        return self.model.cache_groups(replayable)

    def new_caches(self, pages_per_group: list[int], page_size: int,
                   companions: list | None = None) -> list:
        """Every rank's caches, the same pages each (its own heads of them)."""
        if companions is not None:
            raise TpError("a draft model's layers in the pages under tensor parallelism are "
                          "not built")
        with self._turn:
            self._send(TpCaches(tuple(pages_per_group), page_size))
            self.caches = self.model.new_caches(pages_per_group, page_size)
        return self.caches

    def new_state_cache(self, slots: int):
        raise TpError("state layers under tensor parallelism are not built")

    def enable_lora(self, slots: int, max_rank: int):
        return self.model.enable_lora(slots, max_rank)      # refused by the shard, by name

    def forward(self, input_ids, meta, cache, logits_indices, lora=None, states=None):
        """Send the round to every worker, then run rank 0's shard."""
        if lora is not None or states is not None:
            raise TpError("LoRA and state layers under tensor parallelism are not built")
        metas = meta if isinstance(meta, list) else [meta]
        check = self.spec.check
        payload = pickle.dumps(TpForward.of(self.round, input_ids, metas, logits_indices, check),
                               protocol=pickle.HIGHEST_PROTOCOL)
        with self._turn:
            try:
                pending = self._send_bytes(payload)
                logits = self.model.forward(input_ids, meta, cache, logits_indices)
                self._written(pending, len(payload))
                if check:
                    compare_views(self.comm, self.round, payload)
            except TpLost as e:
                self._lose(e)
                raise
            self.round += 1
        return logits

    def gather_pages(self, group: int, pages) -> list:
        """Every rank's heads of `pages` of cache group `group`, in rank
        order (each [pages, layers, 2, page_size, its KV heads, head_dim]):
        a look at the engine's KV whole (tests)."""
        msg = TpPageMove(TpPageMoveKind.GATHER, group, np.asarray(pages, dtype=np.int64))
        with self._turn:
            try:
                self._send(msg)
                return move_pages(self.comm, self.caches[msg.group].data, msg)
            except TpLost as e:
                self._lose(e)
                raise

    # ---- the group ----------------------------------------------------------------------
    def _send(self, msg) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._written(self._send_bytes(payload), len(payload))

    def _send_bytes(self, payload: bytes) -> cf.Future | None:
        """Write `payload` to every worker's pipe. A worker has read every
        earlier message by the time rank 0 sends the next (it met rank 0 in
        the last round's collectives after reading that round), so a small
        message always fits the empty pipe and is written in place. A large
        one (a pipe holds 64 KiB) would block on a worker that has stopped:
        it goes to a sender thread, and the Future returned is waited on
        (`_written`) after rank 0's own forward."""
        if self.lost is not None:
            raise self.lost
        for rank, proc in enumerate(self.procs, start=1):
            if proc.exitcode is not None:
                self._lose(TpLost(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with "
                                  f"code {proc.exitcode}"))
        if len(payload) <= IN_PLACE_BYTES:
            self._write_all(payload)
            return None
        if self._sender is None:
            self._sender = cf.ThreadPoolExecutor(1, thread_name_prefix="tp-send")
        return self._sender.submit(self._write_all, payload)

    def _written(self, pending: cf.Future | None, size: int) -> None:
        """Wait (the collectives' timeout at most) for a round the sender
        thread writes: rank 0 runs its own shard meanwhile."""
        if pending is None:
            return
        try:
            pending.result(self.spec.timeout_s)
        except cf.TimeoutError:
            self._lose(TpLost(f"a {size:,}-byte round was not taken by every tensor-parallel "
                              f"rank within {self.spec.timeout_s:g} s (a rank has stopped "
                              "reading)"))

    def _write_all(self, payload: bytes) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                conn.send_bytes(payload)
            except OSError as e:
                self._lose(TpLost(f"tensor-parallel rank {rank} (pid {proc.pid}): its pipe "
                                  f"broke: {e}"))

    def _lose(self, e: TpLost) -> None:
        if self.lost is None:
            self.lost = e
            log.error("tensor-parallel engine lost: %s", e)
            self.on_lost(e)
        raise self.lost

    def alive(self) -> bool:
        return self.lost is None and all(p.exitcode is None for p in self.procs)

    def close(self) -> None:
        """Stop the workers (each closes its end of the group) and leave it."""
        if self.lost is None:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(TpStop()))
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(10)
        self._kill()
        if self._sender is not None:
            self._sender.shutdown(wait=False)
        self.comm.close()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_engine_model(path: str | None, preset: str | None, *, dtype: str = "auto",
                      device: str = "cpu", attention: str = "auto", tensor_parallel_size: int = 1,
                      timeout_s: float = 60.0, check: bool = False, on_lost=_raise,
                      quantization: str = "auto", expert_parallel: bool = False):
    """(model, tokenizer) for an engine: the model itself at size 1, else
    rank 0 of a group of `tensor_parallel_size` (a TpLeader, its workers
    started). The ranks' shards are dequantized (`quantization` gguf refused);
    `expert_parallel`: a MoE's experts sharded whole over them."""
    if tensor_parallel_size == 1:
        from pdserve.kernels.models.loader import load_model

        return load_model(path, preset, dtype=dtype, device=device, attention=attention,
                          quantization=quantization)
    if quantization == "gguf":
        raise ModelError(f"model.quantization: gguf with tensor_parallel_size "
                         f"{tensor_parallel_size}: the shards are dequantized; use "
                         "model.quantization: none or auto, or tensor_parallel_size 1")
    spec = TpSpec(path, preset, dtype, attention, device, tensor_parallel_size, timeout_s, check,
                  expert_parallel)
    leader = TpLeader(spec, on_lost)
    return leader, leader.tokenizer
