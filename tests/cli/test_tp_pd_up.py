"""`pdserve up` with prefill and decode engines of different (or equal)
tensor-parallel sizes: P TP 1 -> D TP 2, P TP 2 -> D TP 1 and P TP 2 ->
D TP 2 each give the greedy tokens of one fused TP 1 engine (`pdserve.LLM`,
float32), every request's KV having crossed from P to D (P's transfers
count them), and once done no engine keeps a pinned page. (D's pages byte
for byte: test_tp_pd.py.)"""

import os
import signal
import subprocess

import pytest
import yaml

from pdserve import LLM, SamplingParams
from pdserve.client import Client
from test_cli_processes import START_BOUND_S, STOP_BOUND_S, Output, pdserve

PROMPTS = ["hello there, prefill and decode", "tensor parallel engines", "a"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def want():
    ref = LLM(dtype="float32", attention="torch", page_size=4, total_pages=512)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.token_ids for o in ref.generate(PROMPTS, greedy, use_tqdm=False)]


@pytest.mark.slow           # Ray's start, and three or four ranks', on 2 cores
@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1), (2, 2)])
def test_up_pd_across_tp_sizes_gives_the_tokens_of_one_fused_tp1_engine(tmp_path, want, p_tp,
                                                                        d_tp):
    cfg = {"model": {"preset": "tiny", "dtype": "float32", "attention": "torch"},
           "engine": {"page_size": 4, "total_pages": 512, "max_scheduled_tokens": 16,
                      "max_batch_size": 8, "tensor_parallel_check": True},
           "cluster": {"prefill": {"count": 1, "tensor_parallel_size": p_tp},
                       "decode": {"count": 1, "tensor_parallel_size": d_tp}}}
    path = tmp_path / "tp-pd.yaml"
    path.write_text(yaml.safe_dump(cfg))
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
            stats = {e["role"]: e for e in c.stats()}
            assert stats["prefill"]["transfers"] == len(PROMPTS)      # each went P -> D
            assert stats["decode"]["transfers"] == len(PROMPTS)       # and landed
            assert stats["prefill"]["pinned_pages"] == 0
            assert stats["decode"]["pinned_pages"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_BOUND_S) == 0, out.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
