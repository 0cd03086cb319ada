"""`pdserve up --model CKPT --prefill 1 --decode 1 -tp 1`, as a vLLM user
types it, serves the tokens `pdserve up --config` serves from the YAML that
says the same, and the config it prints at start is that YAML's config.
Served, two deployments in turn (slow); the config the command line hands
the Deployment, in-process with none started (fast). `generate` and `bench
serve` take the same flags."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest
import yaml

from support.lora import tiny_llama
from pdserve.client import Client
from pdserve.config import load_config
from test_cli_processes import START_BOUND_S, STOP_BOUND_S, Output, pdserve

PROMPTS = [[5, 17, 42, 9, 3, 77, 12, 8, 30, 2, 61], [1, 2, 3], [200, 100]]
MAX_TOKENS = 8
# pdserve up's default config (deploy/local-pd.yaml) with the checkpoint as its model
ENGINE = {"page_size": 16, "total_pages": 1024, "max_scheduled_tokens": 256,
          "max_batch_size": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("up-model-flags") / "ckpt"
    tiny_llama(d)
    return d


@pytest.fixture
def equivalent(checkpoint, tmp_path):
    """The YAML that says what the flags below say."""
    path = tmp_path / "equivalent.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(checkpoint)},
        "engine": {**ENGINE, "tensor_parallel_size": 1},
        "cluster": {"prefill": 1, "decode": 1}}))
    return path


def flags(checkpoint) -> list[str]:
    return ["--model", str(checkpoint), "--prefill", "1", "--decode", "1", "-tp", "1"]


class _Started(Exception):
    """What the stand-in Deployment raises: up got as far as starting one."""


def test_up_hands_the_deployment_the_equivalent_yamls_config_and_prints_it(
        checkpoint, equivalent, tmp_path, monkeypatch, capsys):
    from pdserve.cli.main import main
    from pdserve.cluster import deploy

    handed = []

    def deployment(cfg, **_):
        handed.append(cfg)
        raise _Started
    monkeypatch.setattr(deploy, "Deployment", deployment)
    with pytest.raises(_Started):
        main(["up", *flags(checkpoint), "--port", "0"])
    assert handed == [load_config(equivalent)]
    printed = tmp_path / "printed.yaml"
    printed.write_text(yaml.safe_dump(printed_config(capsys.readouterr().out.splitlines(True))))
    assert load_config(printed) == handed[0]


@contextlib.contextmanager
def started(*args: str):
    """`pdserve up ARGS --port 0`, started: yields its output (Output);
    SIGTERM on the way out, and it must exit cleanly."""
    proc = subprocess.Popen(pdserve("up", *args, "--port", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = Output(proc)
    try:
        yield out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_BOUND_S) == 0, out.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def serving(out: Output) -> str:
    """The gRPC address once it serves."""
    return out.wait_for(r"pdserve: serving gRPC on (\S+:\d+)", START_BOUND_S).group(1)


def greedy(address: str) -> list[list[int]]:
    with Client(address, timeout=STOP_BOUND_S) as c:
        return [c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0,
                           ignore_eos=True).token_ids for p in PROMPTS]


def printed_config(lines: list[str]) -> dict:
    """The YAML document up printed at start (between --- and ...)."""
    start = lines.index("---\n")
    return yaml.safe_load("".join(lines[start:lines.index("...\n", start) + 1]))


@pytest.mark.slow          # two deployments, one after the other: 25-40 s on 2 cores
def test_up_with_model_flags_serves_the_tokens_of_the_equivalent_yaml(checkpoint, equivalent,
                                                                      tmp_path):
    with started(*flags(checkpoint)) as flagged:
        got = greedy(serving(flagged))
    printed = tmp_path / "printed.yaml"
    printed.write_text(yaml.safe_dump(printed_config(flagged.lines)))
    assert load_config(printed) == load_config(equivalent)
    with started("--config", str(equivalent)) as filed:
        want = greedy(serving(filed))
    assert got == want
    assert all(len(t) == MAX_TOKENS for t in got)


def test_offline_generate_takes_the_model_flags_without_a_config(checkpoint, capsys):
    from pdserve import LLM, SamplingParams
    from pdserve.cli.main import main

    assert main(["generate", "--model", "tiny", "--dtype", "float32", "--max-tokens", "5",
                 "hello"]) == 0
    want = LLM(dtype="float32").generate("hello", SamplingParams(max_tokens=5, temperature=0),
                                         use_tqdm=False)[0].text
    assert capsys.readouterr().out == want + "\n"
    assert main(["generate", "--address", "127.0.0.1:1", "--model", str(checkpoint),
                 "hi"]) == 2
    assert "--model with --address" in capsys.readouterr().err


def test_bench_serve_starts_the_file_up_would_run_with_the_same_flags(checkpoint, tmp_path):
    from pdserve.benchmarks.serving.serve import with_model_flags
    from pdserve.config import UP_CONFIG, Flags, load_with_flags

    flags = Flags(model_path=str(checkpoint), fused=1, max_num_seqs=4)
    saved = with_model_flags(UP_CONFIG, flags, tmp_path / "flagged.yaml")
    assert load_config(saved) == load_with_flags(UP_CONFIG, flags)[0]

