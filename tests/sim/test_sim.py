"""`pdserve sim`: the DESIGN.md contract (config, trace, result JSON, plan
log), determinism, and clear errors for bad input."""

import json
from pathlib import Path

import pytest

from pdserve.cli.main import main
from pdserve.config import ServeConfig, load_config
from pdserve.sim.simulation import Simulation
from pdserve.sim.trace import TraceError, read_trace
from pdserve.sim.cost.roofline import GPUS, MODELS, CostModel
from pdserve.scheduler import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEMO_CFG = ROOT / "deploy" / "sim-demo.yaml"
DEMO_TRACE = ROOT / "deploy" / "demo-trace.jsonl"

REQUEST_KEYS = {"id", "status", "error", "ttft_s", "tpot_s", "e2e_s", "output_tokens",
                "retractions"}
SUMMARY_KEYS = {"finished", "rejected", "failed", "unfinished", "virtual_seconds",
                "output_tok_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"}
OP_KEYS = {"req", "op", "begin", "tokens", "replay"}


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def run_cli(tmp_path, cfg, trace, plans=True):
    out = tmp_path / "out.json"
    args = ["sim", "--config", str(cfg), "--trace", str(trace), "--out", str(out),
            "--no-progress"]
    if plans:
        args += ["--plans", str(tmp_path / "plans.jsonl")]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_demo_trace_finishes_every_request_and_follows_the_result_contract(tmp_path, capsys):
    res = run_cli(tmp_path, DEMO_CFG, DEMO_TRACE)
    assert set(res["summary"]) == SUMMARY_KEYS
    assert res["summary"]["finished"] == 48 and res["summary"]["unfinished"] == 0
    for r in res["requests"]:
        assert set(r) == REQUEST_KEYS
        assert r["status"] == "finished" and 0 < r["ttft_s"] <= r["e2e_s"]
    assert "output_tok_per_s" in capsys.readouterr().out


def test_output_tokens_in_the_trace_end_each_request(tmp_path):
    res = run_cli(tmp_path, DEMO_CFG, DEMO_TRACE, plans=False)
    want = {json.loads(line)["id"]: json.loads(line)["output_tokens"]
            for line in DEMO_TRACE.read_text().splitlines()}
    assert {r["id"]: r["output_tokens"] for r in res["requests"]} == want


def test_plan_log_has_one_line_per_nonempty_round_in_the_documented_shape(tmp_path):
    run_cli(tmp_path, DEMO_CFG, DEMO_TRACE)
    lines = [json.loads(x) for x in (tmp_path / "plans.jsonl").read_text().splitlines()]
    assert lines
    engines = set()
    for ln in lines:
        assert set(ln) == {"t", "engine", "role", "round", "ops", "free_pages", "total_pages"}
        assert ln["ops"] and 0 <= ln["free_pages"] <= ln["total_pages"]
        engines.add(ln["engine"])
        for op in ln["ops"]:
            assert set(op) == OP_KEYS and op["op"] in (
                "prefill", "decode", "remote_prefill", "remote_decode", "retract", "readmit",
                "store", "load")
    assert engines == {"fused-0", "fused-1"}          # the router used both


def test_same_trace_and_config_give_identical_results_and_plans(tmp_path):
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ra, rb = run_cli(a, DEMO_CFG, DEMO_TRACE), run_cli(b, DEMO_CFG, DEMO_TRACE)
    assert ra == rb
    assert (a / "plans.jsonl").read_text() == (b / "plans.jsonl").read_text()


def test_mooncake_lines_share_prefixes_through_their_hash_ids(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 1200, "output_length": 4, "hash_ids": [0, 1, 3]}]
    trace = write(tmp_path, "mc.jsonl", "\n".join(json.dumps(r) for r in rows))
    cfg = write(tmp_path, "c.yaml", "cluster: {fused: 1, prefill: 0, decode: 0}\n"
                                     "engine: {page_size: 16, total_pages: 512}\n")
    run_cli(tmp_path, cfg, trace)
    plans = [json.loads(x) for x in (tmp_path / "plans.jsonl").read_text().splitlines()]
    second = [op for ln in plans for op in ln["ops"] if op["req"] == "mc1" and op["op"] == "prefill"]
    assert second[0]["begin"] == 1024                 # two shared 512-token blocks hit


def test_a_request_the_pool_cannot_hold_is_rejected_with_the_reason(tmp_path):
    trace = write(tmp_path, "t.jsonl",
                  '{"id": "big", "arrival_s": 0, "prompt_tokens": 5000, "max_new_tokens": 4}\n'
                  '{"id": "ok", "arrival_s": 0, "prompt_tokens": 50, "max_new_tokens": 4}\n')
    cfg = write(tmp_path, "c.yaml", "cluster: {fused: 1, prefill: 0, decode: 0}\n"
                                     "engine: {page_size: 16, total_pages: 64}\n")
    res = run_cli(tmp_path, cfg, trace)
    big, ok = res["requests"]
    assert big["status"] == "rejected" and "total_pages" in big["error"]
    assert ok["status"] == "finished"
    assert res["summary"]["rejected"] == 1


def test_azure_csv_traces_are_read_with_arrivals_relative_to_the_first_row(tmp_path):
    p = write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                  "2023-11-16 18:15:46.6805900,374,44\n"
                                  "2023-11-16 18:15:50.9951690,396,109\n")
    reqs = read_trace(p)
    assert [len(r.prompt) for r in reqs] == [374, 396]
    assert reqs[0].arrival_s == 0 and abs(reqs[1].arrival_s - 4.3145789) < 1e-6


@pytest.mark.parametrize("line,words", [
    ('{"id": "a", "arrival_s": -1, "prompt_tokens": 3}', "arrival_s"),
    ('{"id": "a", "arrival_s": 0}', "give one of"),
    ('{"id": "a", "prompt_tokens": 0}', "prompt_tokens"),
    ('{"id": "a", "prompt_tokens": 3, "max_new_tokens": "lots"}', "max_new_tokens"),
    ('{"id": "a", "hash_ids": [1], "prompt_tokens": 900}', "block_tokens"),
    ('not json', "not valid JSON"),
])
def test_bad_trace_lines_name_the_line_and_the_field(tmp_path, line, words):
    p = write(tmp_path, "t.jsonl", '{"id": "ok", "prompt_tokens": 3}\n' + line + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert "t.jsonl:2" in str(e.value) and words in str(e.value)


def test_unknown_config_keys_are_named(tmp_path):
    p = write(tmp_path, "c.yaml", "engine: {page_size: 16}\nrouting: {}\n")
    with pytest.raises(ConfigError, match="unknown key config.routing; did you mean config.router"):
        load_config(p)
    p = write(tmp_path, "c.yaml", "simulate: {gpu: h100, card: x}\n")
    with pytest.raises(ConfigError, match="unknown key simulate.card"):
        load_config(p)
    p = write(tmp_path, "c.yaml", "engnie: {page_size: 16}\n")
    with pytest.raises(ConfigError, match="unknown key config.engnie; did you mean config.engine"):
        load_config(p)


def test_cli_reports_config_errors_without_a_traceback(tmp_path, capsys):
    cfg = write(tmp_path, "c.yaml", "cluster: {fused: 1, prefill: 0, decode: 0}\n"
                                     "simulate: {gpu: tpu9}\n")
    code = main(["sim", "--config", str(cfg), "--trace", str(DEMO_TRACE),
                 "--out", str(tmp_path / "o.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown simulate.gpu 'tpu9'" in err and "h100" in err


def test_a_cluster_that_cannot_serve_is_refused():
    with pytest.raises(ConfigError, match="nothing could serve"):
        ServeConfig.from_dict({"cluster": {"prefill": 0, "decode": 2, "fused": 0}})


def test_sim_runs_the_simulator_on_parsed_traces_directly():
    cfg = load_config(DEMO_CFG)
    sim = Simulation(cfg, read_trace(DEMO_TRACE, limit=5), progress=False)
    res = sim.run()
    assert res["summary"]["finished"] == 5
    for se in sim.engines:
        se.engine.planner.assert_idle()


@pytest.mark.parametrize("tokens", [512, 1024, 2048])
def test_cost_model_prefill_tracks_distserve_a100_profile(tokens):
    # DistServe's fitted OPT-13B prefill time on one A100 (shared/data/perf):
    # ms = a + b * tokens + c * tokens^2
    a, b, c = 18.10254647486372, 0.1019122572698738, 7.122264314252114e-06
    want = (a + b * tokens + c * tokens ** 2) / 1000
    got = CostModel(MODELS["opt-13b"], GPUS["a100"]).round_seconds([(0, tokens)], 0, 0)
    assert abs(got - want) / want < 0.3


@pytest.mark.parametrize("batch,ctx", [(1, 512), (16, 1024), (64, 512)])
def test_cost_model_decode_tracks_distserve_a100_profile(batch, ctx):
    # small-batch decode: ms = a + b * total context tokens + c * batch
    a, b, c = 19.934702624895458, 0.0006269356524350583, 0.03850697740828398
    want = (a + b * batch * ctx + c * batch) / 1000
    got = CostModel(MODELS["opt-13b"], GPUS["a100"]).round_seconds([], batch * ctx, batch)
    assert abs(got - want) / want < 0.3


def _tight_run(tmp_path, host_pages, extra=()):
    rows = [{"id": f"t{i}", "arrival_s": i * 0.01, "hash_ids": [0, 1 + i % 3],
             "prompt_tokens": 700, "max_new_tokens": 400} for i in range(12)]
    trace = write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows))
    cfg = write(tmp_path, "c.yaml", "cluster: {fused: 1, prefill: 0, decode: 0}\n"
                                     "engine: {page_size: 16, total_pages: 160, safe_steps: 32, "
                                     f"host_pages: {host_pages}}}\n")
    out = tmp_path / "o.json"
    assert main(["sim", "--config", str(cfg), "--trace", str(trace), "--out", str(out),
                 "--plans", str(tmp_path / "p.jsonl"), "--no-progress", *extra]) == 0
    ops = [op["op"] for ln in (tmp_path / "p.jsonl").read_text().splitlines()
           for op in json.loads(ln)["ops"]]
    return json.loads(out.read_text()), ops


@pytest.mark.parametrize("host_pages", [0, 400])
def test_a_tight_pool_retracts_and_still_finishes_every_request(tmp_path, host_pages):
    res, ops = _tight_run(tmp_path, host_pages)
    assert res["summary"]["finished"] == 12
    assert sum(r["retractions"] for r in res["requests"]) == ops.count("retract") > 0
    if host_pages:
        assert "store" in ops and "load" in ops and "readmit" in ops


def test_strict_admission_never_retracts(tmp_path):
    res, ops = _tight_run(tmp_path, 0, extra=["--strict"])
    assert res["summary"]["finished"] == 12 and "retract" not in ops


def test_a_trace_line_can_ask_for_strict_admission(tmp_path):
    p = write(tmp_path, "t.jsonl", '{"id": "a", "prompt_tokens": 3, "strict": true}\n'
                                   '{"id": "b", "prompt_tokens": 3}\n')
    assert [r.strict for r in read_trace(p)] == [True, False]
    p = write(tmp_path, "t.jsonl", '{"id": "a", "prompt_tokens": 3, "strict": "yes"}\n')
    with pytest.raises(TraceError, match="'strict' must be true or false"):
        read_trace(p)


# ---- disaggregation --------------------------------------------------------

PD_CFG = ("engine: {page_size: 16, total_pages: 2048, max_scheduled_tokens: 2048}\n"
          "cluster: {prefill: 2, decode: 2, fused: 0}\n"
          "simulate: {gpu: h100, model: llama-3-8b, lease_s: 2.0}\n")


def run_pd(tmp_path, faults=None, cfg_text=PD_CFG):
    cfg = load_config(write(tmp_path, "pd.yaml", cfg_text))
    from pdserve.sim.fault_plan import load_faults
    from pdserve.sim.simulation import build_engines

    fl = []
    if faults is not None:
        names = [e.name for e in build_engines(cfg)]
        fl = load_faults(write(tmp_path, "faults.yaml", faults), names)
    sim = Simulation(cfg, read_trace(DEMO_TRACE), progress=False, faults=fl)
    res = sim.run()
    for se in sim.engines:
        if se.alive:
            se.planner.assert_idle()
    return sim, res


def test_disaggregated_run_hands_every_request_from_p_to_d(tmp_path):
    sim, res = run_pd(tmp_path)
    assert res["summary"]["finished"] == 48
    assert res["counters"]["remote_prefills"] == res["counters"]["transfers"] == 48
    roles = {se.name: se.role.value for se in sim.engines}
    assert roles == {"prefill-0": "prefill", "prefill-1": "prefill",
                     "decode-0": "decode", "decode-1": "decode"}


def test_disaggregated_output_lengths_match_fused(tmp_path):
    _, pd = run_pd(tmp_path)
    fused = Simulation(load_config(DEMO_CFG), read_trace(DEMO_TRACE), progress=False).run()
    assert [r["output_tokens"] for r in pd["requests"]] == \
        [r["output_tokens"] for r in fused["requests"]]


def test_disaggregated_runs_are_deterministic(tmp_path):
    faults = "- {at_s: 1.0, kind: transfer_fail}\n- {at_s: 2.0, kind: ack_lost}\n"
    assert run_pd(tmp_path, faults)[1] == run_pd(tmp_path, faults)[1]


def test_a_failed_transfer_recovers_locally_on_d(tmp_path):
    _, res = run_pd(tmp_path, "- {at_s: 0.5, kind: transfer_fail, engine: prefill-0}\n"
                              "- {at_s: 2.0, kind: transfer_fail}\n")
    c = res["counters"]
    assert c["transfer_failures"] == 2 and c["local_recoveries"] == 2
    assert res["summary"]["finished"] == 48


def test_a_lost_ack_is_released_by_the_lease(tmp_path):
    _, res = run_pd(tmp_path, "- {at_s: 1.0, kind: ack_lost}\n")
    assert res["counters"]["lost_acks"] == 1 == res["counters"]["lease_expiries"]
    assert res["summary"]["finished"] == 48


def test_a_dead_prefill_engine_hands_its_prompts_to_local_recovery(tmp_path):
    # 4.4 s falls in the trace's burst of arrivals at 4.32-4.50 s: prefill-1
    # dies holding prompts that decode engines asked it for
    _, res = run_pd(tmp_path, "- {at_s: 4.4, kind: engine_death, engine: prefill-1}\n")
    c = res["counters"]
    assert c["engine_deaths"] == 1
    assert c["local_recoveries"] >= 1 and c["transfer_failures"] == 0   # the death, not a fault
    assert res["summary"]["finished"] == 48


def test_a_dead_decode_engine_fails_its_requests_with_a_reason(tmp_path):
    _, res = run_pd(tmp_path, "- {at_s: 2.0, kind: engine_death, engine: decode-0}\n")
    failed = [r for r in res["requests"] if r["status"] == "failed"]
    assert failed and all("decode-0 died" in r["error"] for r in failed)
    assert res["summary"]["finished"] + len(failed) == 48


@pytest.mark.parametrize("text,words", [
    ("- {at_s: 1, kind: meteor}\n", "kind must be one of"),
    ("- {at_s: -1, kind: ack_lost}\n", "at_s must be"),
    ("- {at_s: 1, kind: engine_death}\n", "needs an engine"),
    ("- {at_s: 1, kind: transfer_fail, engine: prefill-9}\n", "no engine named 'prefill-9'"),
    ("- {at_s: 1, kind: ack_lost, when: now}\n", "unknown key when"),
])
def test_bad_fault_files_say_what_is_wrong(tmp_path, text, words):
    with pytest.raises(ConfigError, match=words):
        run_pd(tmp_path, text)


def test_a_decode_engine_that_dies_before_its_prompt_reaches_p_leaks_nothing_on_p(tmp_path):
    cfg = load_config(write(tmp_path, "c.yaml", PD_CFG.replace(
        "cluster: {prefill: 2, decode: 2, fused: 0}", "cluster: {prefill: 1, decode: 1, fused: 0}")
        .replace("lease_s: 2.0", "lease_s: 2.0, link_latency_s: 0.5")))
    from pdserve.sim.fault_plan import Fault

    trace = write(tmp_path, "t.jsonl", '{"id": "a", "arrival_s": 1.0, "prompt_tokens": 100, '
                                       '"max_new_tokens": 4}\n')
    sim = Simulation(cfg, read_trace(trace), progress=False,
                     faults=[Fault(1.2, "engine_death", "decode-0")])
    res = sim.run()
    assert res["requests"][0]["status"] == "failed"
    sim.engines[0].planner.assert_idle()              # prefill-0 holds nothing
    assert sim.engines[0].load == 0
