"""Extra TTFT on a healthy P's requests while another P is frozen (SIGSTOP),
issue 53's measurement of the send queue per peer (engine/peer/messages.py).

    .venv/bin/python tools/frozen_peer_ttft.py [FREEZE_S]           # this checkout
    PYTHONPATH=/tmp/old/src .venv/bin/python tools/frozen_peer_ttft.py   # another tree

One local deployment (2P+1D, the default tiny model, the default transfer
timeouts: landing 30 s, lease 10 s, heartbeat 2 s). Requests go straight
to D (Submit with prefill_peer), so which P prefills each is fixed:
prefill-1 stays healthy, prefill-0 is frozen (its process SIGSTOPped,
found by the port it listens on) for FREEZE_S (40) while D keeps being
sent requests for it, two a second. Requests for prefill-1 are sent open
loop, two a second, before (10 s), during and after (5 s) the freeze.
TTFT = Submit -> the first token on D's event stream. It prints each
phase's p50, p90 and max, and how much the freeze added over the
baseline's p50.
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import sys
import threading
import time

import psutil

from pdserve.cluster.deploy import Deployment
from pdserve.config import ServeConfig
from pdserve.proto import control_pb2 as cpb
from pdserve.proto import control_pb2_grpc as cpbg
from pdserve.proto import router_pb2 as rpb
from pdserve.proto.control_tls import channel

FREEZE_S = float(sys.argv[1]) if len(sys.argv) > 1 else 40.0
ENGINE = {"page_size": 16, "total_pages": 1024, "max_scheduled_tokens": 256,
          "max_batch_size": 64}
ids = itertools.count()


def listener_pid(address: str) -> int:
    port = int(address.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid)


class D:
    """A subscription on the decode engine; submit() returns the request id,
    first[rid] is set to the monotonic time of its first token."""

    def __init__(self, dep):
        tls = dep.control.for_party("measure") if dep.control is not None else None
        self.ch = channel(dep.router.engines["decode-0"].address, tls)
        self.stub = cpbg.EngineControlStub(self.ch)
        self.events = self.stub.Subscribe(cpb.SubscribeRequest(subscriber="measure"))
        next(self.events)
        self.first: dict[str, float] = {}
        self.sent: dict[str, float] = {}
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for msg in self.events:
                now = time.monotonic()
                with self.cv:
                    for ev in msg.events:
                        if (ev.token_ids or ev.error) and ev.request_id not in self.first:
                            self.first[ev.request_id] = now
                    self.cv.notify_all()
        except Exception:
            pass

    def submit(self, peer: str, tokens: int = 200) -> str:
        rid = f"m{next(ids)}"
        k = next(ids)
        prompt = [(7 * i + 13 * k + i * i) % 90 + 5 for i in range(tokens)]
        self.sent[rid] = time.monotonic()
        self.stub.Submit(cpb.SubmitRequest(
            request_id=rid, token_ids=prompt, prefill_peer=peer, subscriber="measure",
            sampling=rpb.SamplingOptions(max_tokens=4, ignore_eos=True)), timeout=60)
        return rid

    def ttft(self, rid: str, wait: float = 120) -> float:
        with self.cv:
            self.cv.wait_for(lambda: rid in self.first, wait)
        return self.first.get(rid, float("inf")) - self.sent[rid]


def healthy_ttfts(d: D, seconds: float, gap: float = 0.5) -> list[float]:
    """Requests via prefill-1, one every `gap` s for `seconds` (open loop:
    each sent on time whatever the ones before it are doing), each TTFT."""
    rids, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        threading.Thread(target=lambda: rids.append(d.submit("prefill-1")), daemon=True).start()
        time.sleep(gap)
    time.sleep(1.0)
    return [d.ttft(rid) for rid in list(rids)]


def summary(xs):
    xs = sorted(xs)
    return (f"n={len(xs)} p50={statistics.median(xs) * 1000:.0f} ms "
            f"p90={xs[int(0.9 * (len(xs) - 1))] * 1000:.0f} ms max={xs[-1] * 1000:.0f} ms; "
            f"over 1 s: {sum(x > 1 for x in xs)}")


def main():
    cfg = ServeConfig.from_dict({"engine": ENGINE, "cluster": {"prefill": 2, "decode": 1}})
    dep = Deployment(cfg, num_cpus=2)
    dep.start()
    try:
        d = D(dep)
        for _ in range(3):                                   # warm both Ps
            d.ttft(d.submit("prefill-0"))
            d.ttft(d.submit("prefill-1"))
        base = healthy_ttfts(d, 10)
        print("baseline (prefill-1):", summary(base), flush=True)

        pid = listener_pid(dep.router.engines["prefill-0"].address)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        stop = threading.Event()

        def load_frozen():                                   # asks keep going to the frozen P
            while not stop.is_set():
                try:
                    d.submit("prefill-0")
                except Exception:
                    pass
                stop.wait(0.5)
        threading.Thread(target=load_frozen, daemon=True).start()
        during = healthy_ttfts(d, FREEZE_S)
        stop.set()
        os.kill(pid, signal.SIGCONT)
        print(f"prefill-0 frozen {time.monotonic() - t0:.0f} s; prefill-1 meanwhile:",
              summary(during), flush=True)
        print("extra TTFT over the baseline's p50 (p50, p90, max):", ", ".join(
            f"{(x - statistics.median(base)) * 1000:.0f} ms" for x in (
                statistics.median(during), sorted(during)[int(0.9 * (len(during) - 1))],
                max(during))), flush=True)
        after = healthy_ttfts(d, 5)
        print("after the thaw (prefill-1):", summary(after), flush=True)
    finally:
        dep.stop()


if __name__ == "__main__":
    main()
