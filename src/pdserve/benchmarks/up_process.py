"""`pdserve up` in a child process, for benchmarks that load a deployment
the way its users do: the router in a process of its own, not sharing the
load generator's interpreter (and GIL)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

STARTUP_S = 300.0       # Ray, the engines' weights, the router
STOP_S = 120.0          # SIGTERM drains (nothing is left by then) and stops Ray
SERVING = re.compile(r"pdserve: serving gRPC on (\S+?)(?:, OpenAI HTTP on (\S+))? \(")


def pdserve_command() -> list[str]:
    """The installed console script beside this interpreter, or the module."""
    script = Path(sys.executable).parent / "pdserve"
    exe = str(script) if script.exists() else shutil.which("pdserve")
    return [exe] if exe else [sys.executable, "-m", "pdserve.cli.main"]


@contextlib.contextmanager
def served(config: str, http: bool = False, up_args=()):
    """Start `pdserve up --config CONFIG [UP_ARGS]` on free ports; yields (gRPC
    address, HTTP base URL or None) once it serves, and stops it (SIGTERM:
    drain, then stop) on the way out. RuntimeError, with the end of its
    output, if it exits or stays silent before serving."""
    cmd = [*pdserve_command(), "up", "--config", config, "--port", "0", *up_args]
    if http:
        cmd += ["--http-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    found: list[tuple] = []
    ready = threading.Event()

    def read() -> None:                       # drained to the end: the pipe never fills
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip())
            m = SERVING.search(line)
            if m and not found:
                found.append(m.groups())
                ready.set()
        ready.set()
    reader = threading.Thread(target=read, name="pdserve-up-output", daemon=True)
    reader.start()
    try:
        if not ready.wait(STARTUP_S) or not found:
            if not reader.is_alive():             # its output ended: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(STOP_S)
            tail = "\n".join(lines[-15:])
            how = (f"exited with {proc.poll()}" if proc.poll() is not None
                   else f"did not serve within {STARTUP_S:.0f} s")
            raise RuntimeError(f"pdserve up --config {config} {how}; its last output:\n{tail}")
        grpc_address, http_url = found[0]
        yield grpc_address, http_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(5)
