"""How long the requests on a frozen decode engine wait before they move on
(issue 53's goal: under 15 s), and whether they finish token-identical with
no copy left decoding on the frozen engine once it thaws.

    .venv/bin/python tools/frozen_decode_failover.py sigstop [FREEZE_S]
    .venv/bin/python tools/frozen_decode_failover.py stuck [FREEZE_S]

One local deployment (1P+2D, the default tiny model, the default liveness
settings: engine.stall_unhealthy_s 5, router.engine_silent_s 5, gRPC
keepalive 2 s + 3 s). REQUESTS greedy streams of MAX_TOKENS, each of its
own prompt, run through the router; once every one streams, decode-0 is
frozen for FREEZE_S (30): `sigstop` stops its process (found by the port it
listens on), `stuck` holds its loop thread with a job that sleeps (the
actor's hold_loop). For each request decode-0 held at the freeze, the time
from the freeze to its first token from elsewhere (a token that arrives
more than 0.5 s after the freeze: what decode-0 had sent by then is in
the sockets within milliseconds) is its failover time; p50 and max are
printed. Every request's tokens are compared with an undisturbed run of
the same prompts, and after the thaw decode-0 must go idle with each of
its copies aborted, none finished.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time

import psutil
import ray

from pdserve.client import Client
from pdserve.cluster.deploy import Deployment
from pdserve.config import ServeConfig

MODE = sys.argv[1] if len(sys.argv) > 1 else "sigstop"
FREEZE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
REQUESTS = 12
MAX_TOKENS = 3000
ENGINE = {"page_size": 16, "total_pages": 4096, "max_scheduled_tokens": 256,
          "max_batch_size": 64}
PROMPTS = [f"request {i}: the frozen decode engine should not strand me" for i in range(REQUESTS)]


def listener_pid(address: str) -> int:
    port = int(address.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid)


class Stream(threading.Thread):
    def __init__(self, client: Client, i: int):
        super().__init__(daemon=True)
        self.client, self.i, self.rid = client, i, f"f{i}-{time.monotonic_ns()}"
        self.chunks: list[tuple[float, list[int]]] = []
        self.error: Exception | None = None
        self.start()

    def run(self):
        try:
            for c in self.client.generate_stream(PROMPTS[self.i], request_id=self.rid,
                                                 max_tokens=MAX_TOKENS, ignore_eos=True):
                self.chunks.append((time.monotonic(), list(c.token_ids)))
        except Exception as e:
            self.error = e

    def tokens(self) -> list[int]:
        return [t for _, ts in self.chunks for t in ts]


def engine_counters(actor) -> dict:
    return ray.get(actor.check.remote(), timeout=30)["counters"]


def main():
    cfg = ServeConfig.from_dict({"engine": ENGINE, "cluster": {"prefill": 1, "decode": 2}})
    dep = Deployment(cfg, num_cpus=2)
    dep.start()
    try:
        router = dep.router
        assert router is not None
        actor = next(a for name, _, a in dep.engines if name == "decode-0")
        with Client(dep.address, timeout=600) as c:
            ref = [Stream(c, i) for i in range(REQUESTS)]
            for s in ref:
                s.join()
            reference = [s.tokens() for s in ref]
            streams = [Stream(c, i) for i in range(REQUESTS)]
            while not all(len(s.tokens()) >= 4 for s in streams):
                time.sleep(0.05)
            held = [s for s in streams
                    if (router.active.get(s.rid) or (None,))[0] is not None
                    and router.active[s.rid][0].name == "decode-0"]
            before = engine_counters(actor)
            pid = listener_pid(router.engines["decode-0"].address)
            t0 = time.monotonic()
            if MODE == "sigstop":
                os.kill(pid, signal.SIGSTOP)
            else:
                ray.get(actor.hold_loop.remote(FREEZE_S), timeout=30)
            time.sleep(FREEZE_S - (time.monotonic() - t0))
            if MODE == "sigstop":
                os.kill(pid, signal.SIGCONT)
            for s in streams:
                s.join(600)
            moved = []
            for s in held:
                after = [t for t, _ in s.chunks if t > t0 + 0.5]
                moved.append(after[0] - t0 if after else float("inf"))
            errors = [s.error for s in streams if s.error]
            same = sum(s.tokens() == r for s, r in zip(streams, reference))
            deadline = time.monotonic() + 60
            while not ray.get(actor.check.remote(), timeout=30)["idle"]:
                assert time.monotonic() < deadline, "decode-0 not idle a minute after the thaw"
                time.sleep(0.2)
            after_c = engine_counters(actor)
            print(f"mode {MODE}, decode-0 frozen {FREEZE_S:.0f} s; {len(held)} of {REQUESTS} "
                  f"requests on it; failover after the freeze: p50 "
                  f"{statistics.median(moved):.1f} s, max {max(moved):.1f} s "
                  f"({', '.join(f'{x:.1f}' for x in sorted(moved))})")
            print(f"token-identical: {same}/{REQUESTS}; errors: {errors}; router counters: "
                  f"{router.counters}; decode-0 copies after the thaw: finished "
                  f"{after_c['finished'] - before['finished']}, aborted "
                  f"{after_c['aborted'] - before['aborted']}")
    finally:
        dep.stop()


if __name__ == "__main__":
    main()
