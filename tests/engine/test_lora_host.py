"""LoRA adapters beyond host memory, and pinning: at most max_cpu_loras
adapters stay in host memory, the least recently used unpinned one is
evicted and re-read from its directory when next needed (refused if the
directory changed since its load); a pinned adapter is never evicted from
host memory and keeps its device slot."""

import os

import pytest
import torch

from support.lora import tiny_adapter, tiny_llama
from pdserve.config import ConfigError, LoraConfig
from pdserve.kernels.lora.adapter import load_adapter
from pdserve.engine.lora.host import AdapterChanged, HostAdapters
from pdserve.scheduler import Planner
from support.planner import config
from support.lora import PROMPTS, greedy
from support.lora import drive, under


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("lorahost")
    tiny_llama(d / "base")
    return d / "base", {n: tiny_adapter(d / n, seed=20 + i, rank=2 + i)
                        for i, n in enumerate("ABCD")}


def host(dirs, capacity, seen=None):
    """A host LRU of `capacity` and the adapters (id, path, weights);
    `seen`: a list each read appends its thread's name to."""
    import threading

    from pdserve.kernels.models.loader import load_model
    base, ads = dirs
    cfg = load_model(str(base), None, dtype="float32", device="cpu", attention="torch")[0].cfg

    def read(p):
        if seen is not None:
            seen.append(threading.current_thread().name)
        return load_adapter(p, cfg)
    return HostAdapters(capacity, read), \
        {n: (i + 1, str(p), load_adapter(p, cfg)) for i, (n, p) in enumerate(ads.items())}


def test_past_capacity_the_least_recently_used_is_evicted_and_reread_on_demand(dirs):
    h, ads = host(dirs, 2)
    for n in "ABC":
        i, path, w = ads[n]
        h.add(i, path, w)
    assert h.held() == [2, 3] and h.evictions == 1          # A, the oldest, went
    again = h.get(1)                                        # read from its directory again
    assert h.reads == 1 and h.held() == [3, 1]              # B was the least recent now
    for (a, b), (a2, b2) in zip(ads["A"][2].weights.values(), again.weights.values()):
        assert torch.equal(a, a2) and torch.equal(b, b2)
    h.get(3)
    assert h.held() == [1, 3] and h.reads == 1              # a hit reads nothing
    h.check_invariants()


def test_a_pinned_adapter_is_never_evicted_from_host_memory(dirs):
    h, ads = host(dirs, 2)
    i, path, w = ads["A"]
    h.add(i, path, w, pinned=True)
    for n in "BCD":
        j, p, wn = ads[n]
        h.add(j, p, wn)
        h.get(j)
    assert 1 in h.held() and len(h.held()) == 2
    h.check_invariants()
    j, p, wn = ads["B"]
    h.add(5, p, wn, pinned=True)
    with pytest.raises(ValueError, match="fill lora.max_cpu_loras=2"):
        h.add(6, p, wn, pinned=True)


def test_an_evicted_adapter_whose_directory_changed_is_refused(dirs, tmp_path):
    """Its load id stands for the weights first read: a rewritten directory
    must come in as a new load, never under the old id."""
    import shutil
    h, ads = host(dirs, 1)
    d = tmp_path / "moving"
    shutil.copytree(ads["A"][1], d)
    from pdserve.engine.lora.host import fingerprint
    h.add(1, str(d), ads["A"][2], stamp=fingerprint(str(d)))
    h.add(2, ads["B"][1], ads["B"][2])                       # evicts load 1
    f = d / "adapter_model.safetensors"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AdapterChanged, match="has changed since it was loaded"):
        h.verify(1)
    with pytest.raises(AdapterChanged, match="load the new files as a new load"):
        h.get(1)
    h.verify(2)                                              # held: nothing to check


def test_a_pinned_load_keeps_its_slot_while_the_others_rotate_through_the_rest():
    p = Planner(config(max_batch_size=8), lora_slots=2)
    p.lora.pin(1)
    for i in range(12):
        p.submit(under(f"r{i}", 1 + i % 4))                  # 1 (pinned), then 2, 3, 4
    drive(p, p.lora)
    p.assert_idle()
    assert p.lora.holder[p.lora.slot_of(1)] == 1            # still there, quiescent
    assert p.lora.slot_of(1) == 0
    with pytest.raises(ValueError, match="one must stay free"):
        p.lora.pin(2)
    p.lora.forget(1)                                        # unloaded: unpinned, slot empty
    assert p.lora.pinned == set() and p.lora.holder[0] == 0


def test_config_pins_by_adapter_and_keeps_a_slot_for_the_rest(tmp_path):
    lora = LoraConfig.from_dict({"adapters": {"a": "/x/a", "b": {"path": "/x/b", "pinned": True}},
                                 "max_loras": 2, "max_cpu_loras": 2})
    assert lora.adapters == (("a", "/x/a"), ("b", "/x/b")) and lora.pinned == ("b",)
    many = LoraConfig.from_dict({"adapters": {f"a{i}": f"/x/{i}" for i in range(5)},
                                 "max_loras": 1, "max_cpu_loras": 2})
    assert len(many.adapters) == 5          # more than host memory keeps: evicted, re-read
    with pytest.raises(ConfigError, match="raise max_loras to 2 or pin fewer"):
        LoraConfig.from_dict({"adapters": {"b": {"path": "/x/b", "pinned": True}}})
    with pytest.raises(ConfigError, match="did you mean lora.adapters.b.pinned"):
        LoraConfig.from_dict({"adapters": {"b": {"path": "/x/b", "pined": True}},
                              "max_loras": 2})
    with pytest.raises(ConfigError, match="pinned must be true or false"):
        LoraConfig.from_dict({"adapters": {"b": {"path": "/x/b", "pinned": "yes"}},
                              "max_loras": 2})


def test_four_adapters_through_two_host_entries_and_a_pinned_one(dirs):
    """max_cpu_loras 2 and max_loras 2 with four adapters, A pinned: a mixed
    batch still gives each request its solo tokens; the others are evicted
    and re-read, A never is, and A keeps its slot."""
    from pdserve import LLM
    base, ads = dirs
    adapters = {n: str(p) for n, p in ads.items()}
    adapters["A"] = {"path": adapters["A"], "pinned": True}
    llm = LLM({"model": {"path": str(base)},
               "engine": {"page_size": 4, "total_pages": 128, "max_scheduled_tokens": 16},
               "lora": {"adapters": adapters, "max_loras": 2, "max_cpu_loras": 2,
                        "max_lora_rank": 8}})
    a = llm.adapters
    assert a.host.held() == [1, 4]           # A pinned, then the last configured
    names = ["A", "B", None, "C", "D", "A", "C", None, "B", "D"]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    mixed = [o.token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False,
                                               adapter=names)]
    assert a.host.reads >= 2 and a.host.evictions >= 2
    assert 1 in a.host.held()
    a.host.check_invariants()
    slots = llm.engine.planner.lora
    assert slots.holder[slots.slot_of(1)] == 1 and slots.pinned == {1}
    alone = [llm.generate([p], greedy(), use_tqdm=False, adapter=n)[0].token_ids
             for p, n in zip(prompts, names)]
    assert mixed == alone
    assert len({tuple(alone[i]) for i in (0, 1, 3, 4)}) == 4
    llm.engine.planner.assert_idle()


def test_a_request_under_an_evicted_adapter_prefetches_it_off_the_forward_thread(dirs):
    """prefetch (a request arrived) re-reads on the reader thread; the
    round's get finds it held, or waits for that read: one read, not two."""
    threads: list[str] = []
    h, ads = host(dirs, 1, threads)
    for n in "AB":
        i, path, w = ads[n]
        h.add(i, path, w)                                   # A evicted by B
    h.prefetch(1)
    h.prefetch(1)                                           # one read under way is enough
    got = h.get(1)                                          # waits for it, if still reading
    assert h.get(1) is got and h.reads == 1 and len(threads) == 1
    assert threads[0].startswith("lora-read")       # the re-read, not the loads above
    h.prefetch(1)                                           # held: nothing to do
    assert h.reads == 1


def test_a_request_under_an_evicted_adapter_whose_directory_changed_is_refused(dirs, tmp_path):
    """Through the engine's check (Submit, RemotePrefill): refused when it
    arrives, saying to load the new files as a new load."""
    import shutil

    from pdserve import LLM
    from pdserve.engine.lora.adapters import AdapterMissing
    base, ads = dirs
    moving = tmp_path / "moving"
    shutil.copytree(ads["A"], moving)
    llm = LLM({"model": {"path": str(base)}, "engine": {"page_size": 4, "total_pages": 64},
               "lora": {"adapters": {"M": str(moving), "B": str(ads["B"])}, "max_loras": 1,
                        "max_lora_rank": 8}})
    assert llm.adapters.host.held() == [2]                   # M evicted by B (one kept)
    assert llm.adapters.check("M", 1) == 1                    # unchanged: prefetched
    llm.adapters.host.get(1)
    llm.adapters.check("B", 2)
    llm.adapters.host.get(2)                                  # M evicted again
    f = moving / "adapter_config.json"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AdapterMissing, match="has changed since it was loaded"):
        llm.adapters.check("M", 1)
