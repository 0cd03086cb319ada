"""router.replicas: several router processes behind one port (SO_REUSEPORT),
each with its own subscription to every engine. A replica that dies loses
only its own streams: the others keep serving, and the engines abort the
dead one's requests and return to idle."""

import threading
import time

import grpc
import pytest
import ray

from pdserve.client import Client

from support.deployed import deployed

ENGINE = {"page_size": 16, "total_pages": 256, "max_scheduled_tokens": 64}


@pytest.fixture(scope="module")
def dep():
    cfg = {"engine": ENGINE, "cluster": {"fused": 1},
           "router": {"replicas": 2}}
    with deployed(cfg, http_port=0) as d:
        yield d


def router_of(address: str) -> tuple[Client, str]:
    c = Client(address, timeout=60)
    return c, c.server_info()["router"]


def test_two_replicas_answer_on_one_port_and_one_dying_loses_only_its_streams(dep):
    # the kernel spreads new connections over the replicas: find one on each
    clients: dict[str, Client] = {}
    deadline = time.monotonic() + 30
    while len(clients) < 2 and time.monotonic() < deadline:
        c, rid = router_of(dep.address)
        clients.setdefault(rid, c)
    assert len(clients) == 2, "every connection reached the same replica"
    replica_ids = {ray.get(r.info.remote())["id"]: r for r in dep.replicas}
    doomed = next(i for i in clients if i in replica_ids)
    survivor = next(i for i in clients if i != doomed)
    for c in clients.values():
        assert c.generate("Hello", max_tokens=4, ignore_eos=True).token_ids
    errors, done = [], {}
    # the doomed replica's request is far too long to end before the kill,
    # however slow or fast this machine runs the survivor's 200 tokens
    budget = {doomed: 3000, survivor: 200}

    def long_one(rid, c):
        try:
            done[rid] = c.generate("x" * 20, max_tokens=budget[rid], ignore_eos=True)
        except grpc.RpcError as e:
            errors.append((rid, e.code()))
    ts = [threading.Thread(target=long_one, args=(i, c)) for i, c in clients.items()]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 60
    while sum(s["running"] for s in clients[survivor].stats()) + (survivor in done) < 2:
        assert time.monotonic() < deadline, "the doomed replica's request never ran"
        time.sleep(0.02)
    ray.kill(replica_ids[doomed], no_restart=True)
    for t in ts:
        t.join(120)
    assert [rid for rid, _ in errors] == [doomed]
    assert len(done[survivor].token_ids) == 200
    # the engine let the dead replica's request go: idle well before it could finish
    deadline = time.monotonic() + 15
    while True:
        stats = clients[survivor].stats()
        if not any(s["running"] or s["used_pages"] for s in stats):
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    assert sum(s["aborted"] for s in stats) >= 1
    dep.replicas = [r for r in dep.replicas if r is not replica_ids[doomed]]
