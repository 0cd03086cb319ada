"""Two Ray nodes on one machine: P on one, D on the other, KV over NIXL,
in bfloat16 (model.dtype reaches every engine; pages move in that dtype)."""

import pytest

from pdserve import LLM, SamplingParams
from pdserve.client import Client
from pdserve.config import ServeConfig
from pdserve.cluster.deploy import Deployment

ENGINE = {"page_size": 16, "total_pages": 256, "max_scheduled_tokens": 64}
MODEL = {"preset": "tiny", "dtype": "bfloat16"}


def _start_two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"p_node": 1}, node_ip_address="127.0.0.1")
        cluster.add_node(num_cpus=1, resources={"d_node": 1}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()          # a half-started cluster must not outlive this module
        raise
    return cluster


@pytest.fixture(scope="module")
def two_nodes():
    """A node that times out at startup (Ray's fixed 30 s, on a loaded host)
    is started again after what it left is killed, as `init_local` does."""
    from pdserve.cluster.local_ray import start_retrying

    cluster = start_retrying(_start_two_nodes)
    yield cluster
    cluster.shutdown()


def test_prefill_and_decode_on_different_nodes(two_nodes):
    import ray

    cfg = ServeConfig.from_dict({"model": MODEL, "engine": ENGINE,
                                 "cluster": {"prefill": 1, "decode": 1, "fused": 0}})
    dep = Deployment(cfg, address=two_nodes.address, loopback=True,
                     placement={"prefill": "p_node", "decode": "d_node"})
    try:
        dep.start()
        info = {name: ray.get(actor.info.remote()) for name, _, actor in dep.engines}
        assert info["prefill-0"]["node_id"] != info["decode-0"]["node_id"]
        assert {i["dtype"] for i in info.values()} == {"bfloat16"}
        prompts = ["two nodes", "two nodes, one prompt each" * 3]
        want = [o.token_ids for o in LLM({"model": MODEL, "engine": ENGINE}).generate(
            prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
            use_tqdm=False)]
        c = Client(dep.address, timeout=120)
        got = [c.generate(p, max_tokens=10, ignore_eos=True).token_ids for p in prompts]
        assert got == want
        stats = {s["name"]: s for s in c.stats()}
        assert stats["pdserve:decode-0"]["transfers"] == 2
        assert not dep.errors()
    finally:
        dep.stop()
