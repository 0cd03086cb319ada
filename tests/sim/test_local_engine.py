"""The simulator's real side without Ray: the config's one fused engine in
this process (sim/local_engine.py), loaded as a client would load a
deployment, and `bench sim-accuracy --in-process` on a Mooncake-format
trace whose shared prefixes both sides keep."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from pdserve.benchmarks.planner.sim_accuracy import level_samples
from pdserve.cli.main import main
from pdserve.config import load_config
from pdserve.scheduler.request import BlockPrompt
from pdserve.sim.cost.profile import TERMS
from pdserve.sim.load import Sample, block_tokens, workload
from pdserve.sim.local_engine import LocalEngine, LocalEngineError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "deploy/local-tiny.yaml"


def mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    """A trace in Mooncake's format: (timestamp ms, input, output, hash_ids) a line."""
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                        "hash_ids": ids}) + "\n" for t, n, o, ids in rows))
    return path


def tiny_profile(tmp_path: Path) -> Path:
    """A cost profile of the tiny model: 1 ms a round, 0.1 ms a prefill
    token, 2 ms a decode."""
    rnd = {t: 0.0 for t in TERMS} | {"overhead_s": 0.001, "prefill_token_s": 1e-4,
                                     "decode_s": 0.002}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(
        {"kind": "pdserve-cost-profile", "version": 1, "copy_bytes_per_s": 1e10, "round": rnd,
         "model": {"name": "tiny", "layers": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 16,
                   "context": 4096, "kv_dtype_bytes": 4}}))
    return path


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine(load_config(TINY))
    yield eng
    eng.close()


def test_a_closed_loop_times_every_request_and_each_round_alone(engine):
    """At concurrency 1 each 40-token prompt is one prefill round and its
    other four tokens four decode rounds of one request."""
    engine.take_rounds()
    r = engine.load(workload(3, 40, 5, None, None, 40, seed=1), 1, None, 0)
    assert (r["ok"], r["failed"], r["arrivals"]) == (3, 0, "closed loop")
    assert r["ttft_s"]["p50"] > 0 and r["tpot_s"]["p50"] > 0
    assert r["output_tok_per_s"] == pytest.approx(15 / r["wall_s"])
    (rounds,) = engine.take_rounds()
    assert [x.kind for x in rounds] == ["prefill", "decode", "decode", "decode", "decode"] * 3
    assert all(x.prefills == ((0, 40),) for x in rounds if x.kind == "prefill")
    assert engine.take_rounds() == [[]]


def test_requests_due_together_share_their_first_round(engine):
    """Open loop: three prompts due at 0 enter before the first round,
    which prefills all three; the queue time is measured from the due time."""
    engine.take_rounds()
    samples = [Sample(s.prompt, 3, 0.0) for s in workload(3, 40, 3, None, None, 40, seed=2)]
    r = engine.load(samples, 8, None, 0)
    assert (r["ok"], r["arrivals"]) == (3, "trace")
    assert r["queued_s"]["p90"] >= 0
    (rounds,) = engine.take_rounds()
    assert len(rounds[0].prefills) == 3 and rounds[1].num_decodes == 3


def test_a_traces_shared_blocks_reach_the_engine_as_a_shared_prefix(engine, tmp_path):
    """Two Mooncake requests of different lengths that share their first
    512-token block: run one after the other, the second prefills only
    what follows the block."""
    trace = mooncake(tmp_path / "mc.jsonl", [(0, 600, 2, [7, 8]), (10, 700, 2, [7, 9])])
    samples = workload(2, 700, 2, str(trace), 2, 700, seed=3)
    assert samples[0].prompt[:512] == samples[1].prompt[:512]
    assert samples[0].prompt[512:] != samples[1].prompt[512:]
    engine.take_rounds()
    engine.load([Sample(s.prompt, 2) for s in samples], 1, None, 0)
    (rounds,) = engine.take_rounds()
    second = [x for x in rounds if x.kind == "prefill"][-1]
    assert second.prefills[0][0] == 512           # its first chunk begins past the block


def test_block_tokens_follow_the_hash_ids_and_the_seed():
    a, b = BlockPrompt([1, 2], 20, 10), BlockPrompt([1, 3], 20, 10)
    assert block_tokens(a, 20, 0)[:10] == block_tokens(b, 20, 0)[:10]
    assert block_tokens(a, 20, 0)[10:] != block_tokens(b, 20, 0)[10:]
    assert block_tokens(a, 20, 0) != block_tokens(a, 20, 1)   # another run shares nothing
    assert len(block_tokens(a, 15, 0)) == 15


def test_a_trace_level_keeps_its_burst_shape_at_the_asked_rate(tmp_path):
    """Scaled to a level's rate, a trace's arrivals keep their order and
    proportions, and average that rate; synthetic prompts arrive Poisson."""
    trace = mooncake(tmp_path / "mc.jsonl", [(0, 50, 2, [1]), (0, 50, 2, [2]),
                                              (3000, 50, 2, [3]), (9000, 50, 2, [4])])
    w = {"requests": 4, "alone": 2, "prompt_len": 32, "max_tokens": 2, "trace": str(trace)}
    due = [s.arrival_s for s in level_samples(w, 2.0, 0)]
    assert due == pytest.approx([0.0, 0.0, 0.5, 1.5])        # 3 gaps in 1.5 s: 2 req/s
    assert all(s.arrival_s is None for s in level_samples(w, None, 0))
    assert all(len(s.prompt) == 32 for s in level_samples(w, None, 0))
    synthetic = level_samples(dict(w, trace=None, requests=400), 5.0, 0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(synthetic, synthetic[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.15)


def test_a_disaggregated_config_is_refused_with_what_to_give(tmp_path):
    with pytest.raises(LocalEngineError, match=r"cluster: \{fused: 1\}"):
        LocalEngine(load_config(ROOT / "deploy/local-tiny-pd.yaml"))


def test_sim_accuracy_in_process_replays_a_trace_and_simulates_each_run(tmp_path, capsys):
    """End to end, no Ray: the tiny engine in process, a Mooncake-format
    trace at concurrency 1 and at half the given saturation, each run
    simulated with the profile."""
    prof = tiny_profile(tmp_path)
    trace = mooncake(tmp_path / "mc.jsonl", [(i * 100, 80, 3, [0, i + 1]) for i in range(4)])
    out = tmp_path / "acc.json"
    assert main(["bench", "sim-accuracy", "--config", str(TINY), "--profile", str(prof),
                 "--in-process", "--trace", str(trace), "--requests", "4", "--alone", "2",
                 "--prompt-len", "64", "--max-tokens", "3", "--fractions", "0.5",
                 "--saturation", "8", "--probe", "1", "--out", str(out)]) == 0
    (res,) = json.loads(out.read_text())
    assert res["in_process"] and res["workload"]["trace"] == str(trace)
    assert [r["level"] for r in res["runs"]] == ["c1", "0.5x"]
    for r in res["runs"]:
        assert r["ok"] == r["requests"] and r["sim"]["ok"] == r["requests"]
        assert r["rounds"]["count"] > 0 and {"sim_own_speed", "sim_probed"} <= set(r)
    assert "| c1 " in capsys.readouterr().out


def test_sim_accuracy_in_process_refuses_a_pd_config_before_loading(capsys, tmp_path):
    prof = tiny_profile(tmp_path)
    assert main(["bench", "sim-accuracy", "--config", str(ROOT / "deploy/local-tiny-pd.yaml"),
                 "--profile", str(prof), "--in-process", "--saturation", "4"]) == 2
    assert "give it cluster: {fused: 1}" in capsys.readouterr().err


def test_a_prompt_the_engine_cannot_take_is_counted_failed_and_the_rest_run(engine):
    """tiny's context is 4,096 tokens: a longer prompt is refused with the
    reason; the others still run."""
    samples = workload(2, 40, 3, None, None, 40, seed=4) + [Sample([1] * 5000, 3)]
    r = engine.load(samples, 4, None, 0)
    assert (r["ok"], r["failed"]) == (2, 1)
    assert "prompt of 5,000 tokens exceeds" in r["errors"][0]


def test_on_cpu_it_runs_a_served_engines_threads_and_gives_the_process_its_own_back():
    import torch

    from pdserve.cluster.cpu_threads import served_threads

    cfg = load_config(TINY)
    before = torch.get_num_threads()
    eng = LocalEngine(cfg)
    try:        # engine.cpu_threads 0: one, as under Ray (unless OMP_NUM_THREADS says)
        assert torch.get_num_threads() == served_threads(cfg, "fused")
    finally:
        eng.close()
    assert torch.get_num_threads() == before
