"""The disk tier in the simulator (sim/disk.py): one store per node that its
engines share, so a prefix one engine computed is a disk hit on another;
its capacity bounds what it keeps."""

from pdserve.config import ServeConfig
from pdserve.scheduler.request import BlockPrompt
from pdserve.sim.simulation import Simulation
from pdserve.sim.trace import TraceRequest


def trace(n: int = 24) -> list[TraceRequest]:
    """Conversations of three turns, each turn the last one's prompt and
    more, turns far enough apart that their engines differ."""
    out = []
    for c in range(n // 3):
        ids = [(c, 0), (c, 1)]
        for turn in range(3):
            ids = ids + [(c, 2 + turn)]
            out.append(TraceRequest(f"c{c}t{turn}", 0.5 * turn + 0.01 * c,
                                    BlockPrompt(list(ids), 512 * len(ids) - 7, 512), 4, 4))
    return sorted(out, key=lambda t: t.arrival_s)


def run(disk: dict | None) -> dict:
    # device and host hold about one conversation: the others' turns evict it
    engine = {"page_size": 16, "total_pages": 400, "host_pages": 256,
              "max_scheduled_tokens": 4096}
    if disk is not None:
        engine["disk_cache"] = disk
    cfg = ServeConfig.from_dict({"engine": engine, "cluster": {"prefill": 0, "decode": 0,
                                                               "fused": 2}})
    return Simulation(cfg, trace(), progress=False).run()


def test_a_shared_disk_serves_prefixes_across_engines():
    off, on = run(None), run({"path": "simulated", "max_bytes": 1 << 40})
    assert off["cached_tokens_by_tier"]["disk"] == 0
    tiers = on["cached_tokens_by_tier"]
    assert tiers["disk"] > 0 and tiers["disk_missed"] == 0
    assert tiers["prompt_tokens"] == off["cached_tokens_by_tier"]["prompt_tokens"]
    all_on = tiers["device"] + tiers["host"] + tiers["disk"]
    all_off = sum(off["cached_tokens_by_tier"][k] for k in ("device", "host"))
    assert all_on > all_off
    assert on["summary"]["finished"] == off["summary"]["finished"] == 24


def test_a_small_disk_evicts_and_a_read_it_evicted_since_the_probe_misses():
    """Capacity bounds what the disk keeps; a page evicted between a
    request's probe and its read is a miss after admission: the request
    re-prefills, and every request still finishes."""
    small = run({"path": "simulated", "max_bytes": 512 * 131072 * 16})   # 512 pages
    big = run({"path": "simulated", "max_bytes": 1 << 40})
    t = small["cached_tokens_by_tier"]
    assert t["disk"] < big["cached_tokens_by_tier"]["disk"]
    assert t["disk_missed"] > 0 and small["summary"]["finished"] == 24


def test_the_simulation_is_deterministic_with_a_disk():
    a, b = run({"path": "simulated"}), run({"path": "simulated"})
    assert a == b
