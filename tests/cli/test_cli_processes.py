"""`pdserve up` and `pdserve demo` as a user runs them: separate processes,
each wait bounded. `up` serves until SIGTERM and then drains and stops
cleanly; `generate` and `stats` talk to it from processes of their own."""

import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pdserve.benchmarks.common.processes import pdserve_command

ROOT = Path(__file__).resolve().parents[2]
START_BOUND_S = 180.0          # Ray and the engines starting on a loaded 2-core machine
STOP_BOUND_S = 60.0
DRAINED_TOKENS = 1000          # a few seconds of the tiny model: still streaming at SIGTERM


def pdserve(*args) -> list[str]:
    return [*pdserve_command(), *args]


class Output:
    """A process's merged stdout and stderr, read on a thread so that a wait
    for a line can have a deadline."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._t.start()

    def _read(self, stream) -> None:
        for line in stream:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern: str, seconds: float) -> re.Match:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break                                   # the process closed its output
            self.lines.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r} within {seconds} s:\n"
                             + "".join(self.lines[-40:]))

    def rest(self, seconds: float = 10.0) -> str:
        self._t.join(seconds)
        while not self._q.empty():
            line = self._q.get()
            if line is not None:
                self.lines.append(line)
        return "".join(self.lines)


def run(*args, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(pdserve(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_up_serves_generate_and_stats_then_stops_on_sigterm():
    proc = subprocess.Popen(
        pdserve("up", "--config", str(ROOT / "deploy" / "local-tiny.yaml"), "--port", "0"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = Output(proc)
    try:
        m = out.wait_for(r"pdserve: serving gRPC on (\S+:\d+)", START_BOUND_S)
        address = m.group(1)
        assert not address.endswith(":0")               # --port 0: the port it bound
        gen = run("generate", "--address", address, "--max-tokens", "6", "hello")
        assert gen.returncode == 0, gen.stderr
        assert len(gen.stdout.rstrip("\n")) == 6        # the tiny model: a character a token
        stats = run("stats", "--address", address)
        assert stats.returncode == 0, stats.stderr
        row = next(ln.split() for ln in stats.stdout.splitlines()
                   if ln.startswith("pdserve:fused-0"))
        assert row[-1] == "1"                           # finished: the one request above
        # SIGTERM drains: a generation streaming then still gets every token
        from contextlib import closing

        from pdserve.client import Client

        with closing(Client(address, timeout=STOP_BOUND_S)) as c:
            stream = c.generate_stream("drain me", max_tokens=DRAINED_TOKENS, ignore_eos=True)
            got = len(next(stream).token_ids)
            proc.send_signal(signal.SIGTERM)
            out.wait_for(r"pdserve: draining every engine", STOP_BOUND_S)
            chunks = list(stream)
        assert got + sum(len(ch.token_ids) for ch in chunks) == DRAINED_TOKENS
        assert chunks[-1].finish_reason == "length"
        assert proc.wait(STOP_BOUND_S) == 0, out.rest()
        assert "fused-0: drained in" in out.rest() and "every request finished" in out.rest()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    # once stopped, nothing answers at the address any more
    gone = run("stats", "--address", address, timeout=60)
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


@pytest.mark.slow          # SmolLM2 loaded by two engines on CPU: a minute or more
def test_demo_streams_answers_over_grpc_and_http_then_exits():
    proc = subprocess.run(pdserve("demo"), capture_output=True, text=True, timeout=900,
                          cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    answers = out[out.index("answers (gRPC, streamed):"):out.index("the same server over")]
    assert len(re.findall(r"^\s+\[\d\] '.+' -> '.+' \(decoded on decode-0\)$", answers,
                          re.M)) == 4
    http = out[out.index("the same server over"):out.index("\nengines:")]
    assert re.search(r"^  '.+'  usage \{.*'completion_tokens': [1-9]", http, re.M), http
    engines = out[out.index("\nengines:"):]
    assert "decode-0" in engines and "prefill-0" in engines
