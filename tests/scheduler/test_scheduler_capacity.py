"""Spec §1.4 (the single-request bound, refusal at ingest), config
validation, and the FSM refusing transitions it does not draw."""

import pytest

from pdserve.scheduler import ConfigError, EngineConfig, Planner, RejectedRequest
from pdserve.scheduler import fsm
from pdserve.scheduler.capacity import ingest_error, max_single_request_tokens, single_request_pages

from support.planner import config, req, run_to_completion


def test_bound_is_the_largest_prompt_whose_working_set_fits():
    cfg = config(page_size=16, total_pages=4096)
    bound = max_single_request_tokens(cfg)
    assert bound == 4096 * 16 - 1          # minus the decode slot
    assert single_request_pages(cfg, bound) <= 4096 < single_request_pages(cfg, bound + 1)


def test_bound_respects_the_model_context():
    """The decode slot behind the prompt needs its positions within the
    context too: a prompt of the whole context could generate nothing."""
    cfg = config(max_context_tokens=1000)
    assert max_single_request_tokens(cfg) == 1000 - cfg.decode_input_tokens
    assert ingest_error(cfg, max_single_request_tokens(cfg), 1) is None


def test_a_request_at_the_bound_is_served():
    p = Planner(config(page_size=4, total_pages=8))
    r = req("edge", max_single_request_tokens(p.cfg), max_new=1)
    p.submit(r)
    run_to_completion(p)
    assert len(r.output) == 1
    p.assert_idle()


def test_a_prompt_beyond_the_bound_is_rejected_with_the_bound_and_the_fix():
    p = Planner(config(page_size=16, total_pages=4096))
    with pytest.raises(RejectedRequest) as e:
        p.submit(req("big", 70_000))
    msg = str(e.value)
    assert "70,000" in msg and "65,535" in msg and "total_pages" in msg and "shorten" in msg
    assert not p.requests


def test_where_the_model_context_binds_the_fix_does_not_say_raise_the_pool():
    p = Planner(config(page_size=16, total_pages=1024, max_context_tokens=4096))
    with pytest.raises(RejectedRequest) as e:
        p.submit(req("long", 10, max_new=5000))
    msg = str(e.value)
    assert "at most 4,086" in msg and "model's context is the limit" in msg
    assert "raise engine.total_pages" not in msg
    with pytest.raises(RejectedRequest) as e:
        p.submit(req("huge", 5000))
    assert "shorten the prompt (the model's context is the limit)" in str(e.value)
    assert "raise engine.total_pages" not in str(e.value)


def test_prompt_plus_max_new_tokens_beyond_the_pool_is_rejected():
    p = Planner(config(page_size=4, total_pages=8))
    with pytest.raises(RejectedRequest, match="lower max_new_tokens to at most 12"):
        p.submit(req("a", 20, max_new=13))


def test_an_empty_prompt_and_a_zero_budget_are_rejected():
    p = Planner(config())
    with pytest.raises(RejectedRequest, match="empty"):
        p.submit(req("a", []))
    with pytest.raises(RejectedRequest, match="max_new_tokens"):
        p.submit(req("b", 3, max_new=0))


def test_a_duplicate_live_id_is_rejected():
    p = Planner(config())
    p.submit(req("a", 3))
    with pytest.raises(RejectedRequest, match="already live"):
        p.submit(req("a", 3))


@pytest.mark.parametrize("field,value,words", [
    ("page_size", 0, "positive integer"),
    ("total_pages", -5, "positive integer"),
    ("host_pages", -1, ">= 0"),
    ("max_scheduled_tokens", 8, "at least page_size"),
    ("enable_mixed_prefill_decode", "yes", "true or false"),
    ("max_batch_size", 1.5, "positive integer"),
])
def test_invalid_config_values_are_named(field, value, words):
    kw = {"page_size": 16, field: value}
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kw)
    assert f"engine.{field}" in str(e.value) and words in str(e.value)


def test_unknown_engine_keys_are_named():
    with pytest.raises(ConfigError, match="unknown key engine.pages_total"):
        EngineConfig.from_dict({"pages_total": 3})
    with pytest.raises(ConfigError, match="unknown key engine.page_sise; did you mean "
                                          "engine.page_size?"):
        EngineConfig.from_dict({"page_sise": 3})
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_dict({"zzz": 3})
    assert "did you mean" not in str(e.value)


def test_illegal_transitions_raise():
    r = req("a", 4)
    with pytest.raises(fsm.FsmError):
        fsm.begin_decoding(r)                 # Waiting cannot decode
    with pytest.raises(fsm.FsmError):
        fsm.finish(r, "length")               # nor finish before it ran
    fsm.abort(r, "client went away")
    with pytest.raises(fsm.FsmError):
        fsm.abort(r, "again")                 # terminal states stay terminal
