"""The disk (L3) tier in a running engine (pdserve.LLM on the CPU): greedy
tokens are the same with the tier on and off, cold, warm and after a
restart; torn, stale and dropped reads are misses that cost recomputation,
never a wrong token; each prefetch policy; write-through under a full host
tier."""

from __future__ import annotations

import threading

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import ConfigError
from pdserve.engine.disk.model_match import weights_fingerprint
from pdserve.engine.disk.tier import DiskTier
from pdserve.scheduler.config import DiskCacheConfig
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.transfer.disk.fake import FakeStore, Faults
from pdserve.transfer.disk.store import DiskStoreError

ENGINE = dict(page_size=4, total_pages=48, host_pages=12, max_scheduled_tokens=64)
SP = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BASE = list(range(10, 58))                      # 48 tokens: a conversation's first turn
TURNS = [BASE + [60 + i, 61 + i, 62 + i] for i in range(3)]


def llm(disk: dict | None = None, **kw) -> LLM:
    engine = dict(ENGINE) | kw
    return LLM(None, **engine, disk_cache=disk)


def tokens(l: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in l.generate(prompts, SP, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The tokens with no disk tier."""
    return tokens(llm(), TURNS)


def with_store(store, policy: str = "wait_complete", **kw) -> LLM:
    """An engine whose disk tier is a handle of its own on `store` (a fake,
    shared like a directory: the engine closes its handle when it is closed
    or collected)."""
    l = llm()
    cfg = DiskCacheConfig(path="fake", prefetch_policy=policy, **kw)
    l.executor.disk = DiskTier(cfg, store.reopened(), model_id=weights_fingerprint(l.model),
                               dtype="float32", layout=l.executor.caches[0].layout(),
                               page_size=ENGINE["page_size"])
    return l


def filled_store(faults: Faults | None = None) -> FakeStore:
    """A fake store holding every full page of TURNS, as an engine wrote them."""
    store = FakeStore(faults)
    w = with_store(store)
    tokens(w, TURNS)
    assert w.executor.disk.flush()
    return store


def probed_then_run(l: LLM, prompt) -> list[int]:
    """Generate `prompt` with its disk probe landed before the first build
    (as when it queued behind other work)."""
    req = Request("probed", list(prompt), SamplingLimits(max_new_tokens=SP.max_tokens))
    l.executor.register(req.id, SP, fallback_seed=1, prompt=req.prompt.tokens)
    l.engine.submit(req)
    l.executor.disk.before_build(l.engine.planner)
    assert l.executor.disk.store.drain()
    while l.engine.has_work():
        l.engine.step()
    l.engine.planner.assert_idle()
    return req.output


def test_greedy_tokens_match_tier_off_cold_warm_and_after_restart(tmp_path, reference):
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}
    cold = llm(disk)
    assert tokens(cold, TURNS) == reference
    assert tokens(cold, TURNS) == reference              # warm: device and host hits
    assert cold.executor.disk.flush()
    cold.executor.close()
    assert list(tmp_path.glob("*.kv"))
    again = llm(disk)                                    # a restart on the same directory
    outs = again.generate(TURNS, SP, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert outs[0].cached_tokens >= 44
    hits = again.engine.planner.hits
    assert hits.disk_tokens >= 44 and hits.disk_missed == 0
    again.engine.planner.assert_idle()
    # what `pdserve stats` and /metrics read
    from pdserve.engine.stats import EngineCounters, stats_pb
    from pdserve.scheduler.round.grammar import Role
    s = stats_pb(again.engine.planner, Role.FUSED, EngineCounters(), {"groups": [], "tokens": 0},
                 "float32", "torch", again.executor.disk.stats())
    assert s.cached_tokens_by_tier["disk"] == hits.disk_tokens
    assert s.disk_cache["bytes_read"] > 0 and s.disk_cache["reads_hit"] >= 1


def test_a_full_host_tier_evicts_and_the_disk_still_serves(tmp_path, reference):
    """Write-through: a page evicted from device and host is still on disk,
    and a later turn reads it from there."""
    l = llm({"path": str(tmp_path), "prefetch_policy": "wait_complete"},
            total_pages=24, host_pages=12)
    assert tokens(l, TURNS[:1]) == reference[:1]
    others = [[1 + j] + [(5 * i + 11 * j) % 90 + 3 for i in range(39)] for j in range(4)]
    tokens(l, others)                                    # push TURNS[0]'s pages out
    assert l.executor.disk.flush()
    assert l.engine.planner.cached_pages(Request("x", TURNS[0])) < 12
    assert tokens(l, TURNS[:1]) == reference[:1]
    assert l.engine.planner.hits.disk_tokens > 0
    l.engine.planner.assert_idle()


def test_torn_files_and_leftovers_of_a_killed_writer_are_never_served(tmp_path, reference):
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}
    w = llm(disk)
    tokens(w, TURNS)
    assert w.executor.disk.flush()
    w.executor.close()
    files = sorted(tmp_path.glob("*.kv"))
    for f in files:                                      # killed mid-write, no rename
        raw = f.read_bytes()
        f.write_bytes(raw[:len(raw) // 2])
    (tmp_path / (files[0].name + ".tmp.999999999")).write_bytes(b"partial")
    again = llm(disk)
    assert not list(tmp_path.glob("*.tmp.*"))
    assert tokens(again, TURNS) == reference
    assert again.engine.planner.hits.disk_tokens == 0
    assert again.executor.disk.stats()["disk_removed_bad"] > 0


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_each_prefetch_policy_serves_the_same_tokens(policy, reference):
    store = filled_store(Faults(latency_s=0.001))
    l = with_store(store, policy)
    assert probed_then_run(l, TURNS[1]) == reference[1]
    assert l.engine.planner.hits.disk_tokens > 0


def test_timeout_lets_a_slow_prefetch_go_with_what_was_read(reference):
    store = filled_store()
    store.faults.latency_s = 0.02                       # 12 reads: well past the timeout
    l = with_store(store, "timeout", prefetch_timeout_s=0.05)
    assert tokens(l, TURNS[:1]) == reference[:1]
    c = l.executor.disk.counts
    assert c.prefetch_timed_out == 1 and c.prefetch_complete == 0
    assert 0 <= l.engine.planner.hits.disk_tokens < 44


def test_a_miss_after_admission_retracts_and_re_prefills(reference):
    """best_effort admits on the probe; the read in the round finds the
    files torn: the request re-prefills and its tokens are the same."""
    store = filled_store()
    l = with_store(store, "best_effort")
    store.faults.torn = _AllChains()                    # every file torn from now on
    assert probed_then_run(l, TURNS[2]) == reference[2]
    hits = l.engine.planner.hits
    assert hits.disk_missed == 1 and l.executor.disk.counts.reads_missed == 1


def test_dropped_reads_and_stale_keys_are_misses(reference):
    store = filled_store()
    store.faults.drop = _AllChains()
    l = with_store(store, "wait_complete")
    assert tokens(l, TURNS[:1]) == reference[:1]
    assert l.engine.planner.hits.disk_tokens == 0
    # l recomputed and wrote its pages through: let those writes end, or
    # l2's reads are answered from the queued bytes, past the faults
    assert l.executor.disk.flush()
    store.faults.drop, store.faults.stale = None, _AllChains()
    l2 = with_store(store, "wait_complete")
    assert tokens(l2, TURNS[1:2]) == reference[1:2]
    assert l2.engine.planner.hits.disk_tokens == 0
    assert l2.executor.disk.stats()["disk_removed_bad"] > 0


def test_a_disk_hit_below_min_hit_tokens_is_not_read(reference):
    store = filled_store()
    l = with_store(store, "wait_complete", min_hit_tokens=4096)
    assert tokens(l, TURNS[:1]) == reference[:1]
    assert l.executor.disk.counts.below_min == 1 and l.engine.planner.hits.disk_tokens == 0


def test_write_through_selective_writes_after_enough_host_hits(tmp_path):
    disk = {"path": str(tmp_path), "write_policy": "write_through_selective", "write_hits": 1}
    l = llm(disk, total_pages=16, host_pages=16)
    tokens(l, TURNS[:1])
    assert l.executor.disk.flush() and not list(tmp_path.glob("*.kv"))
    tokens(l, [[1] + [(5 * i) % 90 + 3 for i in range(39)]])           # TURNS[0] leaves the device
    tokens(l, TURNS[:1])                                 # a host hit: now written
    assert l.executor.disk.flush()
    assert l.engine.planner.hits.host_tokens > 0 and list(tmp_path.glob("*.kv"))


class _AllChains:
    def __contains__(self, chain) -> bool:
        return True


def test_disk_cache_settings_are_checked_with_the_fix_named(tmp_path):
    with pytest.raises(ConfigError, match="needs a host tier.*host_pages > 0"):
        LLM(None, page_size=4, total_pages=48, disk_cache={"path": str(tmp_path)})
    with pytest.raises(ConfigError, match="unknown key engine.disk_cache.max_byte; did you "
                                          "mean engine.disk_cache.max_bytes"):
        llm({"path": str(tmp_path), "max_byte": 5})
    with pytest.raises(ConfigError, match="prefetch_policy must be one of best_effort, "
                                          "wait_complete, timeout; got 'eager'"):
        llm({"path": str(tmp_path), "prefetch_policy": "eager"})
    f = tmp_path / "a-file"
    f.write_text("")
    with pytest.raises(DiskStoreError, match="engine.disk_cache.path=.*cannot be created"):
        llm({"path": str(f / "kv")})


def test_openai_usage_reports_cached_prompt_tokens():
    """usage.prompt_tokens_details.cached_tokens: what the engine's
    admission found cached, carried on the stream's last delta."""
    from pdserve.router.openai_answers import usage
    from pdserve.router.stream import Delta, _joined

    assert usage(50, 6, 44)["prompt_tokens_details"] == {"cached_tokens": 44}
    last = _joined(Delta([1], "a", [], "", "e"), Delta([2], "b", [], "stop", "e", 44))
    assert last.cached_tokens == 44 and last.finish_reason == "stop"


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_tier_off_cold_warm_and_after_restart(tmp_path):
    """The real model on the CPU: the same check as the tiny one's."""
    engine = {"page_size": 16, "total_pages": 64, "host_pages": 32,
              "max_scheduled_tokens": 512}
    model = {"preset": "smollm2-135m"}
    prompts = [list(range(1000, 1200)) + [5, 6, 7, i] for i in range(3)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    off = [o.token_ids for o in LLM({"model": model, "engine": engine}).generate(
        prompts, sp, use_tqdm=False)]
    disk = {"path": str(tmp_path), "prefetch_policy": "wait_complete"}
    on = LLM({"model": model, "engine": engine | {"disk_cache": disk}})
    assert [o.token_ids for o in on.generate(prompts, sp, use_tqdm=False)] == off
    assert [o.token_ids for o in on.generate(prompts, sp, use_tqdm=False)] == off
    assert on.executor.disk.flush()
    on.executor.close()
    again = LLM({"model": model, "engine": engine | {"disk_cache": disk}})
    outs = again.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == off
    assert again.engine.planner.hits.disk_tokens >= 192


def test_write_through_skips_pages_past_the_write_backlog():
    """With write_backlog pages already queued to write, a page stored to
    host is not queued too (it stays on host; the disk is behind); once
    the backlog drains, a later store of it is written."""
    gate = threading.Event()
    store = FakeStore(Faults(writes_open=gate))
    tier = DiskTier(DiskCacheConfig(path="fake", write_backlog=2), store, model_id="m",
                    dtype="float32", layout="kv:1", page_size=4)
    tier.stored(100, 0, lambda: b"p0" * 8)
    assert store.writing.wait(10)                # the first write runs, held at the gate
    for c in range(1, 6):
        tier.stored(100 + c, c, lambda c=c: bytes([c]) * 16)
    assert (tier.counts.writes, tier.counts.writes_dropped) == (3, 3)
    gate.set()
    assert tier.flush()
    tier.stored(105, 5, lambda: bytes([5]) * 16)
    assert tier.flush() and tier.counts.writes == 4
    assert len(store.files) == 4
    tier.close()


GEMMA = dict(sliding_window=8, layer_types=("sliding_attention", "full_attention"))
QWEN35 = dict(layer_types=("linear_attention", "full_attention"))
LFM2 = dict(layer_types=("conv", "full_attention"))


@pytest.mark.parametrize("arch,extra,named", [
    ("mistral", dict(sliding_window=16), "no full-history attention layer"),
    ("qwen3_5", QWEN35, "1 layer keeping a recurrent state, and engine.state_checkpoints "
                        "is off"),
    ("lfm2", LFM2, "1 layer keeping a recurrent state, and engine.state_checkpoints is off"),
])
def test_a_model_the_tier_cannot_restore_is_refused_by_name(arch, extra, named):
    """A model whose hit would need a state checkpoint none is kept of, or
    with no full-history layer, is refused at start, its family and what
    the tier cannot restore named, the fix said."""
    import dataclasses
    import re

    from pdserve.kernels.models.model_config import tiny_config
    from pdserve.engine.disk.model_match import check_model_served

    disk = DiskCacheConfig(path="unused")
    mcfg = dataclasses.replace(tiny_config(), arch=arch, num_layers=2, **extra)
    with pytest.raises(ConfigError, match=rf"{arch} has .*{re.escape(named)}.*Remove engine.disk_cache"):
        check_model_served(disk, mcfg, state_checkpoints=False)
    check_model_served(disk, tiny_config())              # full history: served
    check_model_served(None, mcfg)                       # no tier: nothing to check


@pytest.mark.parametrize("arch,extra", [("gemma3", GEMMA), ("qwen3_5", QWEN35), ("lfm2", LFM2)])
def test_windows_and_states_with_checkpoints_are_served(arch, extra):
    """Windows, replayed (§1.3) or cached (their tails written and read
    with the pages), and state checkpoints (§1.2, written and read with
    the pages): the tier serves them all."""
    import dataclasses

    from pdserve.kernels.models.model_config import tiny_config
    from pdserve.engine.disk.model_match import check_model_served

    mcfg = dataclasses.replace(tiny_config(), arch=arch, num_layers=2, **extra)
    for replay in (True, False):
        check_model_served(DiskCacheConfig(path="unused"), mcfg, sliding_replay=replay)


def test_a_probe_whose_first_page_is_absent_reads_nothing(tmp_path):
    """The file store answers at once (one stat) that a prompt's first
    uncached page has no file: the probe ends there, with no prefetch to
    wait for, and the tokens are those without the tier."""
    l = llm({"path": str(tmp_path / "kv"), "prefetch_policy": "wait_complete"})
    assert tokens(l, [TURNS[0]]) == tokens(llm(), [TURNS[0]])
    c, s = l.executor.disk.counts, l.executor.disk.store.stats
    assert (c.probes, c.probes_absent, c.prefetched_pages, s.gets) == (1, 1, 0, 0)
    assert l.executor.disk.flush() and s.puts > 0        # written through all the same
