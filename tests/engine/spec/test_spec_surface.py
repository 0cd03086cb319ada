"""Speculation's surface: the config key and `pdserve up
--speculative-config`, the Stats fields, the Prometheus metrics by vLLM's
names, and the line `pdserve stats` prints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve import LLM, SamplingParams
from pdserve.cli.stats import spec_summary
from pdserve.config import Flags, ServeConfig, with_flags
from pdserve.proto import router_pb2 as pb
from pdserve.engine.stats import spec_fields
from pdserve.router.metrics import _EngineCollector
from pdserve.scheduler import ConfigError
from pdserve.scheduler.speculation import SpecMethod


def speculative_from_flag(data: dict, text: str) -> ServeConfig:
    """`data` with `pdserve up --speculative-config TEXT` over it."""
    return ServeConfig.from_dict(with_flags(data, Flags(speculative_config=text)))


def test_the_top_level_key_and_the_flag_set_the_engines_speculation():
    file = {"speculative": {"method": "ngram", "num_speculative_tokens": 5}}
    cfg = ServeConfig.from_dict(file)
    assert cfg.engine.speculative.method is SpecMethod.NGRAM
    assert cfg.engine.decode_input_tokens == 6
    flagged = speculative_from_flag(file, '{"method": "ngram", "num_speculative_tokens": 2, '
                                          '"prompt_lookup_max": 3}')
    assert flagged.engine.speculative.k == 2 and flagged.engine.decode_input_tokens == 3
    with pytest.raises(ConfigError, match="set both at the top level and as engine"):
        ServeConfig.from_dict({"speculative": {}, "engine": {"speculative": {}}})
    with pytest.raises(ConfigError, match="not JSON"):
        speculative_from_flag(file, "{method: ngram}")
    with pytest.raises(ConfigError, match="method is 'medusa', which does not exist; use one "
                                          "of ngram, draft"):
        speculative_from_flag(file, '{"method": "medusa"}')
    with pytest.raises(ConfigError, match="draft_model"):
        ServeConfig.from_dict({"speculative": {"method": "draft"}})


def engine_stats(llm) -> pb.EngineStats:
    return pb.EngineStats(name="pdserve:fused-0", role="fused",
                          **spec_fields(llm.executor.spec))


def test_stats_metrics_and_the_cli_line_carry_acceptance():
    llm = LLM(speculative={"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                           "gate": False})
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=24, temperature=0,
                                                            ignore_eos=True), use_tqdm=False)
    c = llm.executor.spec.counts
    assert c.drafts > 0
    s = engine_stats(llm)
    assert s.spec_decode["num_drafts"] == c.drafts and s.spec_gate == "ungated"
    assert list(s.spec_accepted_per_pos) == c.accepted_per_pos
    col = _EngineCollector()
    col.snapshot = [(SimpleNamespace(name="fused-0"), s)]
    reg = CollectorRegistry()
    reg.register(col)
    text = generate_latest(reg).decode()
    assert f'pdserve:spec_decode_num_drafts_total{{engine="fused-0",role="fused"}} ' \
           f'{float(c.drafts)}' in text
    for name in ("num_draft_tokens_total", "num_accepted_tokens_total"):
        assert f"pdserve:spec_decode_{name}{{" in text
    assert 'pdserve:spec_decode_num_accepted_tokens_per_pos_total{engine="fused-0",' \
           'position="0",role="fused"}' in text
    row = {"name": "fused-0", "spec_decode": dict(s.spec_decode),
           "spec_accepted_per_pos": list(s.spec_accepted_per_pos), "spec_gate": s.spec_gate,
           "spec_tokens_per_s": (0.0, 0.0)}
    line = spec_summary(row)
    assert f"mean acceptance length {c.mean_acceptance_length:.2f}" in line
    assert "gate ungated" in line
