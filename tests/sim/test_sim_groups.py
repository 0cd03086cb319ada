"""The simulator with cache groups: model presets that know their layer mix,
a cost model that charges a sliding layer only its window, simulations that
serve a preset's groups, and `pdserve bench cache-groups`'s arithmetic."""

import dataclasses
from pathlib import Path

import pytest

from pdserve.benchmarks.cache import groups as bench
from pdserve.benchmarks.cache.bounds import kv_pool_bytes
from pdserve.cli.main import main
from pdserve.config import ClusterShape, ServeConfig, SimulateConfig, load_config
from pdserve.sim.simulation import Simulation
from pdserve.sim.trace import TraceRequest
from pdserve.sim.cost.roofline import GPUS, MODELS, CostModel, window_pairs
from pdserve.scheduler import ConfigError, EngineConfig
from pdserve.scheduler.cache.groups import FULL
from pdserve.scheduler.capacity import sliding_request_pages
from pdserve.scheduler.request import BlockPrompt

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "deploy" / "demo-trace.jsonl"
GEMMA = MODELS["gemma-3-27b"]
# the same model with every layer attending over the whole context
GEMMA_DENSE = dataclasses.replace(GEMMA, sliding_layers=0, window=0)


def test_gemma_3_27b_has_one_full_group_of_ten_layers_then_one_sliding_group_of_52():
    full, sliding = GEMMA.groups()
    assert not full.sliding and full.layers == tuple(range(5, 62, 6))
    assert sliding.sliding and sliding.window == 1024 and len(sliding.layers) == 52
    assert set(full.layers).isdisjoint(sliding.layers)
    # 2 x 16 KV heads x 128 x bf16 = 8 KiB a token a layer
    assert GEMMA.group_kv_bytes_per_token(GEMMA.groups()) == [10 * 8192, 52 * 8192]
    assert GEMMA.groups(sliding=False) == [FULL]
    assert GEMMA.group_kv_bytes_per_token([FULL]) == [62 * 8192] == [GEMMA.kv_bytes_per_token]


def test_gpt_oss_alternates_sliding_and_full_layers_and_computes_with_active_params():
    oss = MODELS["gpt-oss-120b"]
    full, sliding = oss.groups()
    assert full.layers == tuple(range(1, 36, 2)) and sliding.window == 128
    assert oss.group_kv_bytes_per_token(oss.groups()) == [18 * 2048, 18 * 2048]
    assert oss.compute_params == 5.1e9 and oss.weight_bytes_total < oss.params


def test_pure_attention_presets_serve_one_full_history_group():
    for name in ("llama-3-8b", "llama-3-70b", "opt-13b", "tiny"):
        assert MODELS[name].groups() == [FULL]


def test_a_preset_with_sliding_layers_needs_a_window():
    with pytest.raises(ConfigError, match="window"):
        dataclasses.replace(GEMMA, window=0)


def test_window_pairs_counts_min_of_position_and_window_keys():
    for begin, n, w in [(0, 5, 8), (3, 10, 8), (100, 7, 8), (6, 1, 8), (0, 1, 1)]:
        assert window_pairs(begin, n, w) == sum(min(p + 1, w) for p in range(begin, begin + n))


def test_a_long_context_decode_round_costs_less_when_sliding_layers_read_only_the_window():
    h100 = GPUS["h100"]
    sliding, dense = CostModel(GEMMA, h100), CostModel(GEMMA_DENSE, h100)
    batch, ctx = 64, 32768
    assert sliding.round_seconds([], batch * ctx, batch) < \
        0.5 * dense.round_seconds([], batch * ctx, batch)
    # a prefill chunk deep into a prompt, too
    assert sliding.round_seconds([(30000, 2048)], 0, 0) < dense.round_seconds([(30000, 2048)], 0, 0)


def test_within_the_window_a_sliding_layer_costs_what_a_full_one_does():
    h100 = GPUS["h100"]
    sliding, dense = CostModel(GEMMA, h100), CostModel(GEMMA_DENSE, h100)
    assert sliding.round_seconds([], 8 * 1000, 8) == pytest.approx(
        dense.round_seconds([], 8 * 1000, 8), rel=1e-12)
    assert sliding.round_seconds([(0, 1024)], 4 * 1024, 4) == pytest.approx(
        dense.round_seconds([(0, 1024)], 4 * 1024, 4), rel=1e-12)


def test_mixed_decode_contexts_are_charged_their_exact_window_sum():
    cost = CostModel(GEMMA, GPUS["h100"])
    # contexts 500 and 40,000: the sliding layers read 500 + 1024 keys
    exact = cost.round_seconds([], 40500, 2, window_contexts=500 + 1024)
    assert exact < cost.round_seconds([], 40500, 2)        # the default bound: 2 x 1024
    assert exact > cost.round_seconds([], 40500, 2, window_contexts=2 * 500)


def _gemma_config(sliding: bool, total_pages=2048, sliding_pages=400, fused=1, pd=False):
    engine = EngineConfig(page_size=16, total_pages=total_pages, sliding_pages=sliding_pages,
                          max_scheduled_tokens=2048, safe_steps=64)
    shape = ClusterShape(prefill=1, decode=1, fused=0) if pd else \
        ClusterShape(prefill=0, decode=0, fused=fused)
    return ServeConfig(engine=engine, cluster=shape,
                       simulate=SimulateConfig(gpu="h100", model="gemma-3-27b",
                                               sliding_groups=sliding))


def _long_trace(n=10):
    """Prompts of 3,000-3,900 tokens, nothing shared: each outgrows the window."""
    return [TraceRequest(f"g{i}", i * 0.05,
                         BlockPrompt([(-1 - i, b) for b in range(8)], 3000 + 100 * i, 512),
                         60, 60) for i in range(n)]


def _watch_pools(sim):
    """Peak pages out per group per engine, seen before every round runs."""
    peaks = {}
    for se in sim.engines:
        run, pl = se.engine.executor.run, se.planner

        def spy(plan, run=run, pl=pl, name=se.name):
            pl.check_invariants()      # includes: no request holds more than window + chunk
            seen = peaks.setdefault(name, [0] * len(pl.coord.groups))
            for g, grp in enumerate(pl.coord.groups):
                seen[g] = max(seen[g], grp.pool.total - grp.pool.num_free)
            return run(plan)
        se.engine.executor.run = spy
    return peaks


def test_a_simulation_with_sliding_groups_finishes_every_request_within_its_pools():
    cfg = _gemma_config(True)
    sim = Simulation(cfg, _long_trace(), progress=False)
    peaks = _watch_pools(sim)
    res = sim.run()
    assert res["summary"]["finished"] == 10 and sim.peak_resident > 1
    (planner,) = [se.planner for se in sim.engines]
    assert [g.window for g in planner.groups] == [0, 1024]
    (peak,) = peaks.values()
    assert 0 < peak[1] <= planner.coord.groups[1].pool.total == 400
    # several requests shared the sliding pool, each far below its history
    assert peak[1] > sliding_request_pages(cfg.engine, 1024, 1)
    planner.assert_idle()


def test_sliding_groups_off_keeps_every_layer_in_one_pool_and_gives_the_same_outputs():
    on = Simulation(_gemma_config(True), _long_trace(), progress=False).run()
    off_sim = Simulation(_gemma_config(False), _long_trace(), progress=False)
    off = off_sim.run()
    assert off_sim.engines[0].planner.groups == [FULL]
    assert [r["output_tokens"] for r in on["requests"]] == \
        [r["output_tokens"] for r in off["requests"]]


def test_a_disaggregated_simulation_ships_every_group():
    sim = Simulation(_gemma_config(True, pd=True), _long_trace(6), progress=False)
    res = sim.run()
    assert res["summary"]["finished"] == 6 and sim.counters["transfers"] == 6
    for se in sim.engines:
        se.planner.assert_idle()


def test_simulate_sliding_groups_is_read_from_yaml_and_checked(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("simulate: {model: gemma-3-27b, sliding_groups: false}\n")
    assert load_config(p).simulate.sliding_groups is False
    p.write_text("simulate: {model: gemma-3-27b, sliding_groups: maybe}\n")
    with pytest.raises(ConfigError, match="sliding_groups"):
        load_config(p)


# ---- the benchmark's arithmetic ---------------------------------------------

def test_at_32k_a_gemma_request_keeps_within_two_points_of_the_ideal_18_7_percent():
    ideal = bench.ideal_ratio(GEMMA, 32 * 1024)
    assert ideal == pytest.approx(0.187, abs=0.001)
    assert abs(bench.retention_ratio(GEMMA, 32 * 1024) - ideal) < 0.02
    # research §5's other lengths, and gpt-oss's windowed 50.2%
    assert bench.ideal_ratio(GEMMA, 8 * 1024) == pytest.approx(0.266, abs=0.001)
    assert bench.ideal_ratio(GEMMA, 128 * 1024) == pytest.approx(0.168, abs=0.001)
    assert bench.retention_ratio(MODELS["gpt-oss-120b"], 32 * 1024) == \
        pytest.approx(0.502, abs=0.005)


def test_the_split_fits_the_pool_and_holds_several_times_the_requests():
    pool = kv_pool_bytes(GEMMA, GPUS["h100"])
    assert pool == pytest.approx(80e9 * 0.9 - 27.4e9 * 2)
    for prompt in (8192, 32768):
        slid = bench.split_pools(GEMMA, pool, prompt, sliding=True)
        full = bench.split_pools(GEMMA, pool, prompt, sliding=False)
        assert slid.pool_bytes <= pool and full.pool_bytes <= pool
        assert full.requests >= 1 and slid.requests >= 3 * full.requests
        # the sliding pool can ramp up: N - 1 residents beside a prefill in flight
        w = sliding_request_pages(EngineConfig(page_size=16), 1024, 1)
        chunk = sliding_request_pages(EngineConfig(page_size=16, max_scheduled_tokens=2048),
                                      1024, 2048)
        assert slid.pool_pages[1] >= (slid.requests - 1) * w + chunk
    assert bench.split_pools(GEMMA, pool, 128 * 1024, sliding=False).requests == 0


@pytest.mark.parametrize("prompt", [8192, 32768])
@pytest.mark.parametrize("sliding", [True, False])
def test_the_planner_holds_exactly_the_requests_the_arithmetic_says(prompt, sliding):
    pool = kv_pool_bytes(GEMMA, GPUS["h100"])
    split = bench.split_pools(GEMMA, pool, prompt, sliding=sliding)
    peak, used, note = bench.planner_peak(GEMMA, split, prompt)
    assert (peak, note) == (split.requests, "")
    assert all(u <= n for u, n in zip(used, split.pool_pages))


def test_bench_cache_groups_prints_both_tables(capsys):
    code = main(["bench", "cache-groups", "--trace", str(TRACE), "--limit", "6"])
    out = capsys.readouterr().out
    assert code == 0, out
    arithmetic, trace = out.split("6 requests of demo-trace.jsonl")
    assert [ln.split()[1] for ln in arithmetic.splitlines() if ln.startswith("   32K")] == \
        ["sliding", "every"]
    fin = {ln.split()[0]: ln.split()[-10] for ln in trace.splitlines()
           if ln.startswith(("sliding ", "every layer "))}
    assert fin == {"sliding": "6", "every": "6"}
