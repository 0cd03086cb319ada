"""LoRA adapters in the simulator (and so in `pdserve plan`): a trace's
`adapter` field selects one, the engines' planners get lora.max_loras
slots (a request waits for a slot; slots rotate only when quiescent), P
prefills under the adapter D decodes with, and a round costs what its
adapters add (sim/lora.py)."""

import json

import pytest

from pdserve.config import ServeConfig
from pdserve.scheduler.request import TokenPrompt
from pdserve.sim.lora import adapter_bytes
from pdserve.sim.simulation import Simulation
from pdserve.sim.trace import TraceError, TraceRequest, read_trace

ENGINE = {"page_size": 16, "total_pages": 2000, "max_scheduled_tokens": 2048}


def trace(adapters, n: int = 24) -> list[TraceRequest]:
    """`n` requests a few ms apart, request i under adapters[i % len]."""
    return [TraceRequest(f"r{i}", 0.002 * i, TokenPrompt([1 + (i * 7 + j) % 900
                                                          for j in range(300)]),
                         32, 32, adapter=adapters[i % len(adapters)])
            for i in range(n)]


def run(adapters, cluster=None, lora=None):
    cfg = ServeConfig.from_dict({"engine": ENGINE,
                                 "cluster": cluster or {"fused": 1},
                                 **({"lora": lora} if lora else {})})
    sim = Simulation(cfg, trace(adapters), progress=False)
    out = sim.run()
    for se in sim.engines:
        se.planner.check_invariants()
        se.planner.assert_idle()
    return sim, out


def test_requests_under_adapters_finish_and_cost_more_than_the_base():
    _, base = run([None])
    sim, under = run(["A", "B", "C", "D"], lora={"max_loras": 4})
    assert under["summary"]["finished"] == base["summary"]["finished"] == 24
    assert under["summary"]["virtual_seconds"] > base["summary"]["virtual_seconds"]
    assert sim.engines[0].engine.executor.lora.slot_loads == 4      # each once, four slots


def test_one_slot_serialises_four_adapters():
    """With max_loras 1 the four adapters take turns in one slot: more slot
    loads and a longer run than four slots."""
    one_sim, one = run(["A", "B", "C", "D"], lora={"max_loras": 1, "max_cpu_loras": 4})
    four_sim, four = run(["A", "B", "C", "D"], lora={"max_loras": 4})
    assert one["summary"]["finished"] == 24
    assert one_sim.engines[0].engine.executor.lora.slot_loads > 4
    assert one["summary"]["virtual_seconds"] > four["summary"]["virtual_seconds"]


def test_p_prefills_under_the_adapter_d_decodes_with():
    sim, out = run(["A", None, "B"], cluster={"prefill": 1, "decode": 1},
                   lora={"max_loras": 2})
    assert out["summary"]["finished"] == 24
    p = next(se for se in sim.engines if se.role.value == "prefill")
    assert p.engine.executor.lora.slot_loads >= 2


def test_an_adapter_the_config_does_not_serve_is_rejected():
    sim, out = run(["A", "Z"], lora={"adapters": {"A": "/x/a"}, "max_loras": 2})
    rejected = [r for r in out["requests"] if r["status"] == "rejected"]
    assert len(rejected) == 12 and "'Z' is not served here" in rejected[0]["error"]


def test_the_trace_field_is_checked(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt_tokens": 10, "max_new_tokens": 2,
                             "adapter": "sql"}) + "\n")
    assert read_trace(f)[0].adapter == "sql"
    f.write_text(json.dumps({"id": "a", "prompt_tokens": 10, "max_new_tokens": 2,
                             "adapter": 3}) + "\n")
    with pytest.raises(TraceError, match="field 'adapter' must be a LoRA adapter's name"):
        read_trace(f)


def test_an_adapters_size_follows_the_model_and_rank():
    from pdserve.sim.cost.roofline import MODELS
    m = MODELS["llama-3-8b"]
    # Llama 3 8B, rank 16 on all seven projections: 42 M weights; the preset
    # has no intermediate width, and the one its parameter count implies
    # counts the embeddings too, so the estimate is about 10% over
    assert 42e6 < adapter_bytes(m, 16) / m.dtype_bytes < 48e6
    assert adapter_bytes(m, 32) == 2 * adapter_bytes(m, 16)


def test_pdserve_plans_yaml_keeps_the_adapters_found_from_its_folder(tmp_path):
    """plan.yaml is written elsewhere than its base config: a relative LoRA
    directory is made absolute, as the cost profile's path is."""
    from types import SimpleNamespace as NS

    import yaml

    from pdserve.sim.plan.report import plan_yaml
    base = tmp_path / "conf" / "base.yaml"
    base.parent.mkdir()
    base.write_text(yaml.safe_dump({"lora": {"adapters": {"a": "ad/a", "b": {
        "path": "ad/b", "pinned": True}, "c": "/abs/c"}, "max_loras": 2}}))
    cand = NS(prefill=0, decode=0, fused=1, chunk=2048, shape="1F")
    result = NS(best=NS(candidate=cand, lo=NS(rate_req_s=1.0)),
                settings=NS(gpus=1, attainment=0.9, slo=NS(ttft_s=1.0, tpot_s=0.05)),
                requests=10)
    out = yaml.safe_load(plan_yaml(base, result, "t.jsonl"))["lora"]["adapters"]
    d = base.parent.resolve()
    assert out == {"a": str(d / "ad/a"),
                   "b": {"path": str(d / "ad/b"), "pinned": True}, "c": "/abs/c"}
