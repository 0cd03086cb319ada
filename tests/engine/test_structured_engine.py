"""Structured outputs in the engine (engine/grammar.py): a constrained
request's greedy tokens are the same fused, 1P+1D, with speculation and with
overlap, through retraction; every output validates against its schema; a
complete grammar finishes `stop`, max_tokens `length`. The tiny preset's
random weights make greedy output arbitrary but deterministic: the grammar
is what makes it valid."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.local_pair import LocalPair
from pdserve.scheduler.config import EngineConfig
from pdserve.scheduler.planner import Planner
from pdserve.scheduler.request import Request, SamplingLimits
from pdserve.scheduler.round.waiting import Hold
from pdserve.text.constraint import Constraint, ConstraintKind

PROMPTS = ["Hello", "The weather in Paris", "xyz", "Return JSON: "]
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"]}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def constrained(max_tokens=80, constraint=Constraint.json_schema(SCHEMA)):
    return SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint)


@pytest.fixture(scope="module")
def llm():
    return LLM(page_size=4)


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(llm, prompts):
    outs = llm.generate(prompts, constrained(), use_tqdm=False)
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.finish_reason == "stop"
    return [o.token_ids for o in outs]


def test_every_output_validates_and_a_complete_grammar_finishes_stop(reference):
    """The fixture validates each text against the schema (a validator, not
    only a parse); the request ends on the closing brace, with no EOS."""
    assert all(reference)


@pytest.mark.parametrize("engine", [
    {"overlap": True},
    {"speculative": SPEC},
    {"speculative": SPEC, "overlap": True},
    {"page_size": 4, "total_pages": 28, "safe_steps": 4},           # retraction mid-request
    {"max_scheduled_tokens": 8},                                    # chunked prompts
])
def test_greedy_constrained_tokens_are_the_same_in_every_mode(llm, prompts, reference, engine):
    other = LLM(**({"page_size": 4} | engine))
    retracted = []
    step = other.engine.step

    def counted():
        out = step()
        if out is not None:
            retracted.extend(op.req.id for op in out.plan.retracts)
        return out
    other.engine.step = counted          # type: ignore[method-assign]
    outs = other.generate(prompts, constrained(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    if "total_pages" in engine:
        assert retracted, "the pool was meant to force a retraction"
    if "speculative" in engine:
        assert other.executor.spec.counts.drafts > 0
    other.engine.planner.assert_idle()


@pytest.mark.parametrize("spec", [None, SPEC])
def test_one_p_and_one_d_give_the_fused_tokens_and_d_never_resamples_ps(llm, prompts,
                                                                          reference, spec):
    """P samples the first token under the grammar; D's matcher takes it
    (and P's candidates) and goes on from there."""
    pd = LocalPair(llm.model, llm.tokenizer,
                   EngineConfig(page_size=4, total_pages=128, max_scheduled_tokens=32,
                                max_context_tokens=512, speculative=spec))
    assert pd.generate(prompts, constrained()) == reference
    pd.D.assert_idle()
    pd.P.assert_idle()


def test_max_tokens_one_on_p_and_d_is_a_valid_first_token_that_ends_length(llm, prompts):
    pd = LocalPair(llm.model, llm.tokenizer,
                   EngineConfig(page_size=4, total_pages=128, max_context_tokens=512))
    out = pd.generate(prompts, constrained(max_tokens=1))
    assert [llm.tokenizer.decode(o) for o in out] == ["{"] * len(prompts)
    fused = llm.generate(prompts, constrained(max_tokens=1), use_tqdm=False)
    assert [o.token_ids for o in fused] == out
    assert {o.finish_reason for o in fused} == {"length"}


def test_max_tokens_cuts_a_constrained_output_with_length(llm, prompts, reference):
    outs = llm.generate(prompts, constrained(max_tokens=5), use_tqdm=False)
    assert [o.token_ids for o in outs] == [r[:5] for r in reference]
    assert {o.finish_reason for o in outs} == {"length"}


@pytest.mark.parametrize("constraint, check", [
    (Constraint.choice(["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
    (Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]{2}"),
     lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-" and t[4:].isalpha()),
    (Constraint(ConstraintKind.GRAMMAR, 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'),
     lambda t: t.startswith("(") and t.endswith(")")),
    (Constraint(ConstraintKind.JSON_OBJECT), lambda t: isinstance(json.loads(t), dict)),
])
def test_each_kind_of_constraint_shapes_sampled_output(llm, prompts, constraint, check):
    sp = SamplingParams(max_tokens=60, temperature=1.0, seed=7, constraint=constraint)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for o in outs:
        if o.finish_reason == "stop":
            assert check(o.text), o.text
    assert any(o.finish_reason == "stop" for o in outs)


def test_unconstrained_rows_beside_constrained_ones_are_untouched(llm, prompts):
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(prompts, free, use_tqdm=False)
    mixed = llm.generate(prompts + prompts, [free] * len(prompts) + [constrained()] *
                         len(prompts), use_tqdm=False)
    assert [o.token_ids for o in mixed[:len(prompts)]] == [o.token_ids for o in alone]


def test_a_request_waits_for_its_grammar_under_its_own_reason():
    p = Planner(EngineConfig(page_size=4, total_pages=64))
    r = Request("r", [1, 2, 3], SamplingLimits(4))
    r.grammar_wait = True
    p.submit(r)
    assert p.build().is_empty()
    (why,) = p.waiting_reasons()
    assert why.reason is Hold.GRAMMAR and "compiling" in why.detail
    r.grammar_wait = False
    assert p.build().prefills


def test_a_compile_past_its_time_limit_fails_the_request_by_name(prompts, monkeypatch):
    import time

    llm = LLM(page_size=4)
    grammars = llm.executor.grammars
    compile_ = grammars._compile

    def slow(constraint):
        time.sleep(0.3)
        return compile_(constraint)
    monkeypatch.setattr(grammars, "_compile", slow)
    grammars.timeout_s = 0.05
    with pytest.raises(RuntimeError, match="took longer than 0.05 s"):
        llm.generate(prompts[:1], constrained(), use_tqdm=False)
    llm.engine.planner.assert_idle()


def test_a_grammar_that_fails_is_the_requests_fault_and_its_client_hears_a_400():
    """The step that fails a request for its grammar says it is invalid (the
    engine's loop sends ERROR_KIND_INVALID), and the router turns that
    kind into INVALID (HTTP 400, gRPC INVALID_ARGUMENT), not a 500; the
    limit is a setting, refused when it is not a positive number."""
    from pdserve.config import ConfigError
    from pdserve.proto import control_pb2 as cpb
    from pdserve.router.errors import ErrorKind
    from pdserve.router.stream import _error_kind
    from pdserve.text.constraint import Constraint, ConstraintKind

    llm = LLM(page_size=4, grammar_compile_timeout_s=7.5)
    assert llm.executor.grammars.timeout_s == 7.5
    req = Request("bad", [1, 2, 3], SamplingLimits(4))
    req.grammar_wait = True
    llm.engine.planner.submit(req)
    llm.executor.grammars.start("bad", Constraint(ConstraintKind.REGEX, "a(b"))
    llm.executor.grammars.wait_any(30)
    out = llm.engine.step()
    assert out.invalid and [r.id for r in out.failed] == ["bad"]
    assert "could not be compiled" in out.error
    llm.engine.planner.assert_idle()
    assert _error_kind(cpb.RequestEvent(error_kind=cpb.ERROR_KIND_INVALID)) is ErrorKind.INVALID
    assert _error_kind(cpb.RequestEvent(error_kind=cpb.ERROR_KIND_FAILED)) is ErrorKind.INTERNAL
    for bad in (0, -1, "30", True):
        with pytest.raises(ConfigError, match="engine.grammar_compile_timeout_s must be"):
            EngineConfig(grammar_compile_timeout_s=bad)


# ---- a property: every output of a generated schema validates ---------------------

def _leaf():
    from hypothesis import strategies as st

    return st.one_of(
        st.just({"type": "boolean"}),
        st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3,
                 unique=True).map(lambda v: {"enum": v}),
        st.just({"type": "null"}),
    )


def _schemas():
    from hypothesis import strategies as st

    def obj(children):
        return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), children,
                               min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req,
                             "additionalProperties": False}))
    arrays = _leaf().flatmap(lambda item: st.integers(0, 3).map(
        lambda n: {"type": "array", "items": item, "maxItems": n}))
    return obj(st.one_of(_leaf(), arrays, obj(_leaf())))


def test_every_greedy_output_of_a_generated_schema_validates(llm, prompts):
    """Bounded schemas (strings with maxLength, integers with bounds, arrays
    with maxItems, enums, nested objects) cannot be finished wrongly: each
    greedy output completes and validates."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_schemas())
    def check(schema):
        outs = llm.generate(prompts[:2], constrained(200, Constraint.json_schema(schema)),
                            use_tqdm=False)
        for o in outs:
            assert o.finish_reason == "stop", (schema, o.text)
            jsonschema.validate(json.loads(o.text), schema)
    check()


def test_a_resubmitted_request_replays_its_earlier_output_into_a_fresh_matcher(llm, prompts,
                                                                                reference):
    """After a fault the router resubmits a request with what it already
    output at the end of its prompt (prior_output): the new engine's matcher
    takes those tokens first, and the rest is the uninterrupted answer's."""
    fresh = LLM(page_size=4)
    k = 9
    sp = constrained()
    req = Request("again", prompts[0] + reference[0][:k], SamplingLimits(sp.max_tokens - k))
    fresh.executor.register(req.id, sp, fallback_seed=1, prompt=req.prompt.tokens,
                            prior_output=k)
    fresh.engine.submit(req)
    while fresh.engine.has_work():
        fresh.engine.step()
    assert req.output == reference[0][k:] and req.finish_reason == "stop"


def test_bench_structured_runs_fused_and_pd_and_prints_its_table(capsys):
    import argparse

    from pdserve.benchmarks.structured import throughput

    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    args = p.parse_args(["--preset", "tiny", "--requests", "4", "--concurrency", "2",
                         "--max-tokens", "24"])
    assert throughput.run(args) == 0
    table = capsys.readouterr().out
    for row in ("| fused | 0% |", "| fused | 100% |", "| pd | 50% |"):
        assert row in table, table
