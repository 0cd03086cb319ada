"""`pdserve up` with tensor-parallel fused engines (cluster: {fused:
{count: 2, tensor_parallel_size: 2}}): each engine's two ranks are its
actor and a process the actor spawned, and their greedy tokens are those
of one TP 1 engine on the same model (`pdserve.LLM`, float32). Then one
engine's worker rank is killed mid-stream: that engine goes down as one
unit (Ray restarts it), and its requests finish on the other engine, each
token the reference's."""

import os
import signal
import subprocess

import pytest
import yaml

from pdserve import LLM, SamplingParams
from pdserve.client import Client
from test_cli_processes import START_BOUND_S, STOP_BOUND_S, Output, pdserve

PROMPTS = ["hello there", "tensor parallel engines", "a"]
MAX_TOKENS = 10
LONG = 400


@pytest.mark.slow           # Ray's start, and four ranks', on 2 cores
def test_up_serves_tp2_fused_engines_with_the_tokens_of_tp1_through_a_rank_lost(tmp_path):
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
    want_long = [o.token_ids for o in ref.generate(PROMPTS, long, use_tqdm=False)]
    proc = subprocess.Popen(pdserve("up", "--config", str(path), "--port", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = Output(proc)
    try:
        address = out.wait_for(r"pdserve: serving gRPC on (\S+:\d+)", START_BOUND_S).group(1)
        with Client(address, timeout=STOP_BOUND_S) as c:
            got = [c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0,
                              ignore_eos=True).token_ids for p in PROMPTS]
            assert got == want
            workers = _tp_workers(proc.pid)
            assert len(workers) == 2                # one a TP 2 engine
            streams = [c.generate_stream(p, max_tokens=LONG, temperature=0.0,
                                         ignore_eos=True) for p in PROMPTS]
            firsts = [next(s) for s in streams]     # every request under way
            os.kill(workers[0], signal.SIGKILL)     # one engine's worker rank
            # that engine goes down whole; the router resubmits its requests to
            # the other one: each still gets its greedy tokens, every one
            for first, stream, w in zip(firsts, streams, want_long):
                tokens = list(first.token_ids)
                for chunk in stream:
                    tokens += chunk.token_ids
                assert tokens == w
        out.wait_for(r"fused-\d failed mid-stream; resubmitting", 5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_BOUND_S) == 0, out.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _tp_workers(root: int) -> list[int]:
    """The tensor-parallel workers among `root`'s descendants: the
    multiprocessing spawn children (Ray's own workers are not spawned so)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        found.append(child)
            except OSError:
                pass
    return sorted(found)
