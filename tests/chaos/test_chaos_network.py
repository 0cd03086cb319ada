"""Chaos, issue 53: a link between two Ray nodes that stalls without closing
(a partition by drop) or degrades (delay and loss), with P on one node and
D on the other.

Two network namespaces on this machine (tests/support/netns.py), one Ray
node in each: the head, both D engines and the router (tests/support/placed_serve.py,
`pdserve up` with roles pinned to nodes) in namespace a; a worker node with
both P engines in namespace b. Every byte between them (Ray's own traffic,
the router's and the peers' gRPC, the KV over UCX, which is told to use TCP:
on one machine it would take shared memory, which no link fault reaches)
crosses one emulated link. Clients reach the router by a side link that no
fault touches.

Ray is told to wait out the fault (GCS health checks and reconnects given
minutes, not seconds), so these tests exercise pdserve's handling of a link
that stalls, not Ray declaring the P node dead, which is another scenario.

The fault lasts FAULT_S, longer than every timeout pdserve has here (the
reasoning of test_chaos_freeze.py's FREEZE_S): a partition (every frame
dropped, both ways), then healed; and a link with 200 ms of delay and 5%
loss in each direction (as `tc netem delay 200ms loss 5%` on both ends would
be; this kernel has no netem), then healed. The rules and figures are
chaos_scenario.py's.

Where namespaces cannot be made (not root, a sandbox, no `ip`), the tests
skip with that reason.

    pytest -m slow tests/chaos/test_chaos_network.py -s
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support import netns as netns_support
from support.chaos_load import OpenLoopLoad, long_prompts, undisturbed
from support.chaos_scenario import Pace, run_and_judge
from support.netns import Impairment, Topology

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

FAULT_S = float(os.environ.get("PDSERVE_CHAOS_FREEZE_S", "45"))
PACE = Pace(interval_s=0.4, max_tokens=500, fault_s=FAULT_S, after_s=20.0)
BAD_LINK = Impairment(delay_s=0.2, loss=0.05)
CONFIG = """\
model: {preset: tiny}
engine: {page_size: 16, total_pages: 8192, max_scheduled_tokens: 512, max_batch_size: 64}
cluster: {prefill: 2, decode: 2}
transfer: {timeout_s: 5, lease_s: 4, heartbeat_s: 1}
"""
ENGINES = {"prefill-0", "prefill-1", "decode-0", "decode-1"}
RAY_PORT = 6379
START_BOUND_S = 300.0
PROMPTS = long_prompts(32, seed=530)
HERE = Path(__file__).resolve().parent
RAY = str(Path(sys.executable).parent / "ray")
# Ray waits out a link fault of minutes: GCS health checks of the P node
# (3 s apart) fail 200 times before it is called dead, and a process cut off
# from the GCS retries for 10 minutes before it exits
RAY_PATIENCE = {"RAY_health_check_failure_threshold": "200",
                "RAY_gcs_rpc_server_reconnect_timeout_s": "600"}


def _env(ucx_device: str) -> dict:
    """The environment of a process in a namespace: conftest's loopback
    switches off (they would pin Ray and UCX to 127.0.0.1), UCX over TCP on
    the link, engines at normal priority, no Ray token (a private cluster)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("UCX_NET_DEVICES", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    return {**env, **RAY_PATIENCE, "UCX_NET_DEVICES": ucx_device, "UCX_TLS": "tcp",
            "RAY_worker_niceness": "0", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


class TwoNodes:
    """The topology, the two Ray nodes and the deployment on them."""

    def __init__(self, topo: Topology, workdir: Path):
        self.topo, self.workdir = topo, workdir
        self.temp = Path(f"/tmp/pdc{topo.tag}")         # Ray's sockets: a short path
        self.lines: list[str] = []
        self.address = ""
        self.serving = threading.Event()

    def start(self) -> str:
        t = self.topo
        head = [RAY, "start", "--head", "--node-ip-address", t.a_ip, "--port", str(RAY_PORT),
                "--num-cpus", "1", "--resources", '{"d_node": 1}', "--include-dashboard=false",
                "--disable-usage-stats", "--temp-dir", str(self.temp)]
        self._run(t.a, head, t.if_a)
        self._run(t.b, [RAY, "start", "--address", f"{t.a_ip}:{RAY_PORT}", "--node-ip-address",
                        t.b_ip, "--num-cpus", "1", "--resources", '{"p_node": 1}',
                        "--disable-usage-stats"], t.if_b)
        config = self.workdir / "config.yaml"
        config.write_text(CONFIG)
        self.driver = t.popen(t.a, [sys.executable, str(HERE.parent / "support" / "placed_serve.py"), "--config",
                                    str(config), "--address", f"{t.a_ip}:{RAY_PORT}",
                                    "--node-ip", t.a_ip, "--host", t.side_ip, "--placement",
                                    "prefill=p_node", "decode=d_node"],
                              env=_env(t.if_a), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        if not self.serving.wait(START_BOUND_S) or not self.address:
            raise AssertionError("the placed deployment did not serve:\n" +
                                 "\n".join(self.lines[-30:]))
        return self.address

    def _run(self, ns: str, cmd: list[str], device: str) -> None:
        r = subprocess.run(["ip", "netns", "exec", ns, *cmd], env=_env(device),
                           capture_output=True, text=True, timeout=START_BOUND_S)
        assert r.returncode == 0, f"{' '.join(cmd[:3])} in {ns} failed:\n{r.stdout[-2000:]}" \
                                  f"\n{r.stderr[-2000:]}"

    def _read(self) -> None:
        for line in self.driver.stdout:
            self.lines.append(line.rstrip())
            m = re.search(r"pdserve: serving gRPC on (\S+:\d+)", line)
            if m:
                self.address = m.group(1)
                self.serving.set()
        self.serving.set()

    def close(self) -> None:
        """The topology's close kills whatever runs in the namespaces (the
        driver, both Ray nodes and their workers); Ray's files go too."""
        self.topo.close()
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    reason = netns_support.unavailable()
    if reason:
        pytest.skip(f"network namespaces unavailable here: {reason}")
    with Topology() as topo:
        n = TwoNodes(topo, tmp_path_factory.mktemp("network"))
        try:
            n.start()
            yield n
        finally:
            n.close()


@pytest.fixture(scope="module")
def reference(nodes):
    return undisturbed(nodes.address, PROMPTS, PACE.interval_s, PACE.max_tokens, "undisturbed")


class LinkFault:
    """The link between the nodes impaired, then healed."""
    victim_engine = None
    stalls_every_stream = False

    def __init__(self, name: str, topo: Topology, impairment: Impairment):
        self.name, self.topo, self.impairment = name, topo, impairment

    def ready(self, load: OpenLoopLoad) -> bool:
        return load.streaming() >= 1

    def begin(self) -> None:
        self.topo.impair(self.impairment)

    def end(self) -> None:
        self.topo.heal()
        print(f"\n  link frames (sent dropped, a->b then b->a): {self.topo.counts()}")


def test_a_partition_between_p_and_d_nodes_strands_no_request_and_leaks_no_page(nodes,
                                                                              reference):
    fault = LinkFault(f"partition {FAULT_S:.0f} s between the P and D nodes", nodes.topo,
                      Impairment(loss=1.0))
    run_and_judge(nodes.address, PROMPTS, reference, PACE, fault, "partition", ENGINES)


def test_a_slow_lossy_link_between_p_and_d_nodes_strands_no_request_and_leaks_no_page(
        nodes, reference):
    fault = LinkFault(f"{BAD_LINK.delay_s * 1000:.0f} ms delay and {BAD_LINK.loss:.0%} loss "
                      f"each way for {FAULT_S:.0f} s", nodes.topo, BAD_LINK)
    run_and_judge(nodes.address, PROMPTS, reference, PACE, fault, "bad-link", ENGINES)
