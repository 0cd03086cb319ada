"""A round that runs ahead (`engine.overlap`, scheduler/round/overlap.py): round
N+1 is built while round N's forward runs, and nothing a client sees changes.

Real tokens: `pdserve.LLM` on the tiny preset, fused. P/D: the simulated
executor under `pdserve sim` (an in-process P/D pair of torch engines needs a
transport between them; the D planner's grammar and the pipeline are the
same code either way)."""

from __future__ import annotations

import dataclasses
import io
import time
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import load_config
from pdserve.engine.engine import Engine
from pdserve.scheduler import ConfigError, EngineConfig, Planner, fsm
from pdserve.scheduler.round import retraction
from pdserve.sim.simulation import Simulation
from pdserve.sim.trace import read_trace

from support.planner import config, req, result_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMPTS = [[5, 17, 42, 9, 3, 77, 12, 8, 30, 2, 61, 40, 7],
           [5, 17, 42, 9, 3, 77, 12, 8, 90, 91, 4],
           list(range(1, 40)),
           [94, 3]]


def greedy(n=20, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in LLM().generate(PROMPTS, greedy(), use_tqdm=False)]


# ---- the real model, fused ------------------------------------------------------

@pytest.mark.parametrize("engine", [
    {},
    {"max_scheduled_tokens": 16},                                    # chunks run ahead too
    {"enable_mixed_prefill_decode": False},
    {"page_size": 4, "total_pages": 24, "safe_steps": 4},            # retraction
    {"page_size": 4, "total_pages": 24, "safe_steps": 4, "host_pages": 64},
])
def test_greedy_tokens_are_identical_with_overlap_on_and_off(reference, engine):
    llm = LLM(overlap=True, **engine)
    assert llm.engine.overlap
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    # the decodes that ran ahead took their input token from the device tensor
    assert llm.executor.fed_on_device > 0
    llm.engine.planner.assert_idle()


def test_a_stop_token_ends_the_output_where_it_does_without_overlap(reference):
    """The stop is sampled in N while the request is already in N+1: N+1's
    token is dropped, text and token ids end where they end without overlap."""
    stop = reference[2][7]                  # mid-generation for prompt 2
    sp = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop])
    off = LLM().generate(PROMPTS, sp, use_tqdm=False)
    llm = LLM(overlap=True)
    on = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in on] == \
        [(o.token_ids, o.text, o.finish_reason) for o in off]
    assert on[2].finish_reason == "stop" and len(on[2].token_ids) <= 8
    llm.engine.planner.assert_idle()


def test_overlap_is_a_validated_engine_key():
    assert EngineConfig.from_dict({"overlap": True}).overlap is True
    assert EngineConfig().overlap is False
    with pytest.raises(ConfigError, match="engine.overlap must be true or false"):
        EngineConfig(overlap="yes")


# ---- the pipeline on a simulated executor ------------------------------------------

class AheadExecutor:
    """launch/wait over `result_for`: token 1 for everyone; `stop_at[id] = k`
    makes a request's k-th token a stop. Records every plan it launches."""

    def __init__(self, stop_at=None):
        self.stop_at = stop_at or {}
        self.launched = []

    def launch(self, plan):
        self.launched.append(plan)
        return plan

    def wait(self, plan):
        sampling = [op.req for op in plan.prefills if op.completes] + list(plan.decodes)
        stopped = [r for r in sampling if len(r.output) + 1 == self.stop_at.get(r.id)]
        return result_for(plan, stopped=stopped)


def _engine(stop_at=None, **kw):
    return Engine("e", Planner(config(overlap=True, **kw)), AheadExecutor(stop_at))


def _drive(engine, each=None, max_steps=1000):
    """Step until idle, checking invariants after every step; returns the
    outcomes."""
    outs = []
    for _ in range(max_steps):
        if not engine.has_work():
            engine.planner.assert_idle()
            return outs
        out = engine.step()
        assert out is not None, engine.planner.stalls
        engine.planner.check_invariants()
        outs.append(out)
        if each:
            each(engine, out)
    raise AssertionError("did not finish")


def test_decodes_run_ahead_with_their_page_counted():
    e = _engine(page_size=4)
    e.submit(req("a", 6, max_new=12))
    ahead = []
    build = e.planner.build

    def spy():
        plan = build()
        # a decode whose last forward is still out has the page for its token
        for r in plan.decodes:
            if r.state.res.forwards_out == 2:
                ahead.append(r.num_tokens)
                assert r.capacity >= r.num_tokens + 1
        return plan
    e.planner.build = spy
    outs = _drive(e)
    assert ahead, "no decode ran ahead"
    (a,) = [r for o in outs for r in o.finished]
    assert len(a.output) == 12


def test_a_request_that_finishes_mid_pipeline_is_released_once_and_late():
    """A stop sampled in N for a request already in N+1: it leaves the
    schedule, its N+1 token is dropped, and it is released, once, when N+1
    lands; its pages are held until then."""
    e = _engine(stop_at={"a": 3})
    e.submit(req("a", 5, max_new=10))
    e.submit(req("b", 5, max_new=10))
    seen = []

    def each(engine, out):
        p = engine.planner
        if "a" in p.ending:
            a = p.ending["a"].req
            seen.append(("ending", a.state.res.forwards_out, len(a.output)))
            assert a.state.res.tables[0], "pages released with its forward out"
    outs = _drive(e, each)
    finished = [r.id for o in outs for r in o.finished]
    assert sorted(finished) == ["a", "b"]                     # each exactly once
    assert seen == [("ending", 1, 3)]
    a = next(r for o in outs for r in o.finished if r.id == "a")
    assert a.output == [1, 1, 1] and a.finish_reason == "stop"
    # released by the round after the stop's: it was in that forward too
    (done,) = [o for o in outs if a in o.finished]
    assert a in done.plan.decodes


def test_no_decode_runs_ahead_past_its_length():
    """A request whose budget N's token spends is not scheduled ahead: it
    finishes at apply(N), never through the late path."""
    e = _engine()
    e.submit(req("a", 5, max_new=3))
    ends = []
    _drive(e, lambda eng, out: ends.append(bool(eng.planner.ending)))
    assert not any(ends)


def test_an_abort_with_a_forward_in_flight_takes_effect_after_it():
    e = _engine()
    e.submit(req("a", 5, max_new=50))
    e.submit(req("b", 5, max_new=6))
    for _ in range(3):
        e.step()
    p = e.planner
    a = p.requests["a"]
    assert a.state.res.forwards_out == 1          # in the forward launched last
    with pytest.raises(fsm.FsmError):
        p.abort("a")                              # the planner still refuses
    assert e.abort("a", "client went away") is None
    assert "a" in p.requests and a.state.res.tables[0]
    p.check_invariants()
    out = e.step()
    assert out.aborted == [a] and a.finish_reason == "abort"
    assert "a" not in p.requests
    n = len(a.output)
    _drive(e)
    assert len(a.output) == n                     # no token landed after the abort


def _out_after(engine, out):
    """The plan whose forward is still out once `out` was applied, if any."""
    launched = engine.executor.launched
    return launched[-1] if launched and launched[-1].round != out.plan.round else None


def _read_by(plan, req) -> bool:
    return plan is not None and (any(r is req for r in plan.decodes)
                                 or any(op.req is req for op in plan.prefills))


@pytest.mark.parametrize("end", ["stop", "abort"])
def test_nothing_is_released_while_a_forward_of_it_is_out(end):
    """The rule behind the planner's FsmError guards, held by the test
    itself: a request that stops, or is aborted, while a forward of it is
    out keeps its pages until that forward lands. No request a step (or
    an abort) releases is in the forward still running after it."""
    e = _engine(stop_at={"a": 3} if end == "stop" else None)
    e.submit(req("a", 5, max_new=50))
    e.submit(req("b", 5, max_new=6))
    late = []

    def each(engine, out):
        late.extend(engine.planner.ending)
        for r in out.finished + out.aborted:
            assert not _read_by(_out_after(engine, out), r), f"{r.id} released mid-forward"
    if end == "abort":
        for _ in range(3):
            each(e, e.step())
        a = e.planner.requests["a"]
        assert a.state.res.forwards_out == 1
        assert e.abort("a", "client went away") is None, "aborted with its forward out"
        late.extend(e.planner.ending)
    _drive(e, each)
    assert "a" in late                                       # the late path ran


def test_an_abort_with_nothing_in_flight_is_immediate():
    e = _engine()
    e.submit(req("a", 5, max_new=5))
    assert e.abort("a", "gone").finish_reason == "abort"
    e.planner.assert_idle()


def test_no_retraction_victim_has_a_forward_in_flight(monkeypatch):
    real = retraction.retract
    victims = []

    def checked(p, b, victim, *rest):
        assert not victim.state.res.forwards_out
        victims.append(victim.id)
        real(p, b, victim, *rest)
    monkeypatch.setattr(retraction, "retract", checked)
    e = _engine(page_size=2, total_pages=20, safe_steps=1)
    for i in range(6):
        e.submit(req(f"r{i}", 5, max_new=12))
    _drive(e)
    assert victims, "the pool never retracted"


def test_a_lost_round_fails_the_round_built_on_it():
    class Failing(AheadExecutor):
        def wait(self, plan):
            if plan.round == 3:
                raise RuntimeError("device lost")
            return super().wait(plan)
    e = Engine("e", Planner(config(overlap=True)), Failing())
    for i in range(3):
        e.submit(req(f"r{i}", 5, max_new=20))
    outs = _drive(e)
    failed = [o for o in outs if o.error]
    assert len(failed) == 1 and {r.id for r in failed[0].failed} == {"r0", "r1", "r2"}


# ---- P/D and determinism through the simulator ---------------------------------------

def _sim(name: str, overlap: bool, limit: int = 40):
    cfg = load_config(DEPLOY / f"{name}.yaml")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, overlap=overlap))
    log = io.StringIO()
    sim = Simulation(cfg, read_trace(DEPLOY / "demo-trace.jsonl", limit=limit), plan_log=log,
                     progress=False)
    outputs, ahead = {}, [0]
    real = sim._finished

    def keep(se, reqs, now):
        for r in reqs:
            outputs[r.id] = (len(r.output), r.finish_reason)
        real(se, reqs, now)
    sim._finished = keep
    for se in sim.engines:
        build = se.planner.build

        def spy(build=build):
            plan = build()
            ahead[0] += sum(1 for r in plan.decodes if r.state.res.forwards_out == 2)
            return plan
        se.planner.build = spy
    sim.run()
    for se in sim.engines:
        se.planner.assert_idle()
        assert not se.planner.stalls
    return outputs, log.getvalue(), ahead[0]


@pytest.mark.parametrize("name", ["sim-demo", "sim-demo-pd"])
def test_outputs_match_and_plans_repeat_in_overlap_mode(name):
    """Fused and P/D (D runs ahead; P has no decodes): every request ends
    as it does without overlap (the simulated tokens name the engine's
    submission order, which the timing of a pipelined round moves, so
    lengths and finish reasons are compared; the torch tests above compare
    tokens), no liveness last resort runs, and the plan log repeats."""
    off, _, none = _sim(name, overlap=False)
    on, log, ahead = _sim(name, overlap=True)
    _, log2, _ = _sim(name, overlap=True)
    assert none == 0 and ahead > 0
    assert on == off and len(on) == 40
    assert log == log2


# ---- CUDA timing ------------------------------------------------------------------

@pytest.mark.device
def test_overlap_on_a_gpu_keeps_tokens_and_reports_its_rate():
    import torch
    prompts = [list(range(3, 3 + 8 + i % 5)) for i in range(64)]
    sp = greedy(64)
    rates, tokens = {}, {}
    for overlap in (False, True):
        llm = LLM(device="cuda", overlap=overlap, max_batch_size=64)
        llm.generate(prompts[:4], greedy(8), use_tqdm=False)          # warm up
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        rates[overlap] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
        tokens[overlap] = [o.token_ids for o in outs]
        llm.engine.planner.assert_idle()
    print(f"\ntiny on CUDA, 64 requests x 64 tokens: overlap off {rates[False]:,.0f} tok/s, "
          f"on {rates[True]:,.0f} tok/s")
    assert tokens[True] == tokens[False]


# ---- the engine server --------------------------------------------------------------

def _overlap_server():
    from support.engine_fakes import Executor, Outputs, Sender

    from pdserve.engine.server import EngineServer
    from pdserve.scheduler.round.grammar import Role

    class Ahead(Executor):
        def launch(self, plan):
            return plan

        def wait(self, plan):
            return self.run(plan)
    planner = Planner(config(overlap=True))
    return EngineServer(Role.FUSED, "fused-0", planner, Ahead(), lambda on_stop: Outputs(),
                        None, incarnation=1, sender=Sender())


def _submit(s, rid):
    from pdserve.proto import control_pb2 as pb
    from pdserve.proto import router_pb2 as rpb
    s.submit(pb.SubmitRequest(request_id=rid, token_ids=[5, 6, 7], subscriber="router",
                              sampling=rpb.SamplingOptions(max_tokens=100)))
    return s.planner.requests[rid]


@pytest.mark.parametrize("how", ["abort", "stop string"])
def test_the_server_ends_a_request_in_flight_after_its_forward(how):
    """A client's abort, or the output thread's stop string, for a request
    whose forward is out: the engine server lets it go once it lands, and
    tells its router then."""
    from support.engine_fakes import one_round, run_jobs

    s = _overlap_server()
    assert s.engine.overlap
    x = _submit(s, "X")
    for _ in range(3):
        one_round(s)
    assert x.state.res.forwards_out == 1
    if how == "abort":
        assert s.abort("X", "client went away")
    else:
        s._stop_string_hit("X", x)
        run_jobs(s)
    assert "X" in s.planner.requests and "X" in s.owner         # not yet: its forward is out
    assert s.counts.aborted == s.counts.finished == 0
    out = one_round(s)
    assert out.aborted == [x] and "X" not in s.planner.requests and "X" not in s.owner
    assert (s.counts.aborted, s.counts.finished) == ((1, 0) if how == "abort" else (0, 1))
    while s.engine.has_work():
        one_round(s)
    s.planner.assert_idle()
