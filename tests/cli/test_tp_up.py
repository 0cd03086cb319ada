"""`pdserve up` with tensor-parallel fused engines (cluster: {fused:
{count: 2, tensor_parallel_size: 2}}): each engine's two ranks are its
actor and a process the actor spawned, and their greedy tokens are those
of one TP 1 engine on the same model (`pdserve.LLM`, float32). Then one
engine's worker rank is killed mid-stream: that engine goes down as one
unit (Ray restarts it), and its requests finish on the other engine, each
token the reference's."""

import os
import re
import signal
import subprocess

import psutil
import pytest
import yaml

from pdserve import LLM, SamplingParams
from pdserve.client import Client
from test_cli_processes import START_BOUND_S, STOP_BOUND_S, Output, pdserve

PROMPTS = ["hello there", "tensor parallel engines", "a"]
# one first page: the router's prefix affinity sends them all to one engine
STREAMED = ["hello there", "hello, tensor parallel engines", "hello a"]
MAX_TOKENS = 10
LONG = 400


@pytest.mark.slow           # Ray's start, and four ranks', on 2 cores
def test_up_serves_tp2_fused_engines_with_the_tokens_of_tp1_through_a_rank_lost(tmp_path):
    """The rank killed is the worker of the engine that holds the streams
    (they share a first page, so the router's prefix affinity sends them
    all to one engine; their chunks name it, its gRPC port leads to its
    process and so to the worker it spawned), never the other engine's,
    which would leave every stream to finish undisturbed. A stream's
    first chunk shows its request under way; it has hundreds of rounds of
    two processes to go when the rank dies a few messages later (about 10
    tokens in on 2 cores). Each stream then shows both engines: the tokens
    before the loss from the one, the rest from the other."""
    cfg = {"model": {"preset": "tiny", "dtype": "float32", "attention": "torch"},
           "engine": {"page_size": 4, "total_pages": 512, "max_scheduled_tokens": 16,
                      "max_batch_size": 8, "tensor_parallel_check": True},
           "cluster": {"fused": {"count": 2, "tensor_parallel_size": 2}}}
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ref = LLM(dtype="float32", attention="torch", page_size=4, total_pages=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in ref.generate(PROMPTS, greedy, use_tqdm=False)]
    long = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
    want_long = [o.token_ids for o in ref.generate(STREAMED, long, use_tqdm=False)]
    proc = subprocess.Popen(pdserve("up", "--config", str(path), "--port", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = Output(proc)
    try:
        address = out.wait_for(r"pdserve: serving gRPC on (\S+:\d+)", START_BOUND_S).group(1)
        ports = _engine_ports(out.lines)
        assert sorted(ports) == ["fused-0", "fused-1"]
        with Client(address, timeout=STOP_BOUND_S) as c:
            got = [c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0,
                              ignore_eos=True).token_ids for p in PROMPTS]
            assert got == want
            streams = [c.generate_stream(p, max_tokens=LONG, temperature=0.0,
                                         ignore_eos=True) for p in STREAMED]
            firsts = [next(s) for s in streams]     # every request under way
            victim = firsts[0].engine
            assert [f.engine for f in firsts] == [victim] * len(STREAMED), firsts
            os.kill(_tp_worker_of(_listening_on(proc.pid, ports[victim])), signal.SIGKILL)
            # that engine goes down whole; the router resubmits its requests to
            # the other one: each still gets its greedy tokens, every one
            for first, stream, w in zip(firsts, streams, want_long):
                chunks = [first, *stream]
                assert [t for ch in chunks for t in ch.token_ids] == w
                engines = [ch.engine for ch in chunks if ch.token_ids]
                assert engines[0] == victim and engines[-1] != victim, (
                    f"{first.request_id} was not on {victim} when its rank died: "
                    f"its tokens came from {sorted(set(engines))}")
        for _ in PROMPTS:
            out.wait_for(rf"{victim} failed mid-stream; resubmitting", STOP_BOUND_S)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_BOUND_S) == 0, out.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _engine_ports(lines: list[str]) -> dict[str, int]:
    """Each engine's gRPC port, from the lines `up` prints as they start."""
    found = (re.search(r"pdserve: (\S+) \(\w+\) at \S+:(\d+):", line) for line in lines)
    return {m.group(1): int(m.group(2)) for m in found if m}


def _listening_on(root: int, port: int) -> int:
    """The process among `root`'s descendants that listens on `port`."""
    for p in psutil.Process(root).children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in p.net_connections(kind="tcp")):
                return p.pid
        except psutil.Error:            # gone, or not ours to read
            continue
    raise AssertionError(f"no process under {root} listens on port {port}")


def _tp_worker_of(engine: int) -> int:
    """The tensor-parallel worker an engine's process spawned (a
    multiprocessing spawn child: Ray's own workers are not started so)."""
    workers = [p.pid for p in psutil.Process(engine).children()
               if "spawn_main" in " ".join(_cmdline(p))]
    assert len(workers) == 1, f"engine process {engine} has workers {workers}"
    return workers[0]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []
