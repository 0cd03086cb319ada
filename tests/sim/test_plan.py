"""`pdserve plan`: the candidates it searches, the bisection's bracket, the
config it writes, determinism whatever runs the probes, and clear errors
for inputs that cannot be planned."""

import json
import math

import pytest

from pdserve.cli.main import main
from pdserve.config import load_config
from pdserve.sim.plan.search import Bracket, Candidate, Settings, Status, candidates, make_plan, search
from pdserve.sim.plan.probe import InProcess, OnTasks, Probe
from pdserve.sim.simulation import Simulation
from pdserve.sim.report import Slo, SloWatch
from pdserve.sim.trace import read_trace, scale_arrivals

TTFT, TPOT = 0.3, 0.05
BASE = """\
# a small pool: Llama-3-8B on simulated H100s
model: {preset: tiny}
engine: {page_size: 16, total_pages: 2048, max_scheduled_tokens: 512, max_batch_size: 64}
cluster: {fused: 2}
simulate: {gpu: h100, model: llama-3-8b}
"""


@pytest.fixture
def files(tmp_path):
    """40 requests at 20 a second: prompts of 300-1,500 tokens, the first
    half sharing a 512-token system prompt, 8-40 new tokens."""
    cfg = tmp_path / "base.yaml"
    cfg.write_text(BASE)
    lines = []
    for i in range(40):
        length = 300 + (i * 389) % 1200
        ids = ([7] if i % 2 == 0 else [1000 + i]) + [2000 + 10 * i + b for b in range(3)]
        out = 8 + (i * 13) % 33
        lines.append(json.dumps({"id": f"q{i}", "arrival_s": i * 0.05, "hash_ids": ids,
                                 "prompt_tokens": length, "max_new_tokens": out}))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    return cfg, trace


def plan_cli(cfg, trace, out, *extra):
    return main(["plan", "--config", str(cfg), "--trace", str(trace), "--ttft", str(TTFT),
                 "--tpot", str(TPOT), "--gpus", "3", "--chunks", "256", "2048",
                 "--out", str(out), "--no-progress", *extra])


def test_candidates_are_n_fused_then_every_split_of_n_for_each_chunk():
    got = [(c.prefill, c.decode, c.fused, c.chunk) for c in candidates(4, (512, 2048))]
    assert got == [(0, 0, 4, 512), (0, 0, 4, 2048), (1, 3, 0, 512), (1, 3, 0, 2048),
                   (2, 2, 0, 512), (2, 2, 0, 2048), (3, 1, 0, 512), (3, 1, 0, 2048)]
    assert all(c.engines == 8 for c in candidates(8, (2048,)))
    assert len(candidates(8, (2048,))) == 8          # fused, 1P+7D ... 7P+1D
    assert [c.shape for c in candidates(1, (512, 2048))] == ["fused x1", "fused x1"]


def fake_probe(factor, passes):
    return Probe(factor, factor, passes, 1.0 if passes else 0.5, not passes, 0,
                 None, None, None, None)


def test_bisection_converges_on_each_candidates_own_boundary():
    """Pass iff factor <= the candidate's threshold: the winner's bracket
    ends around its threshold, within the tolerance; the loser ends failing
    at a rate the winner passes (converged on its own, or dropped)."""
    cands = candidates(2, (512,))                      # fused x2, 1P+1D
    limit = {0: 3.0, 1: 0.7}

    fused, split = search(cands, [10.0, 1.0], lambda i, f: (i, f),
                          lambda job: fake_probe(job[1], job[1] <= limit[job[0]]),
                          tolerance=0.05, width=2)
    assert fused.status is Status.CONVERGED
    assert fused.lo.factor <= 3.0 < fused.hi.factor <= fused.lo.factor * 1.05
    assert split.hi.factor <= fused.lo.factor
    assert split.status is Status.DOMINATED or split.lo.factor <= 0.7 < split.hi.factor


def test_a_candidate_that_never_passes_or_never_fails_stops_with_a_status():
    b = Bracket(Candidate(0, 0, 1, 512), start=1.0)
    while (f := b.next_factor(0.1)) is not None:
        b.record(fake_probe(f, False))
    assert b.status is Status.INFEASIBLE and b.lo is None
    b = Bracket(Candidate(0, 0, 1, 512), start=1.0)
    while (f := b.next_factor(0.1)) is not None:
        b.record(fake_probe(f, True))
    assert b.status is Status.UNBOUNDED and b.hi is None


def test_a_rivals_passing_rate_is_the_next_probe_until_within_tolerance_of_it():
    b = Bracket(Candidate(1, 1, 0, 512), start=4.0)
    assert b.next_factor(0.1, rival=0.0) == 4.0        # nobody passes yet: its own ceiling
    assert b.next_factor(0.1, rival=2.0) == 2.0        # can it keep up with the leader?
    b.record(fake_probe(2.0, True))
    assert b.next_factor(0.1, rival=2.1) == 4.0        # within 10%: its own search again
    b.record(fake_probe(4.0, False))
    assert b.next_factor(0.1, rival=2.1) == math.sqrt(8.0)


def test_a_candidate_failing_at_a_rate_another_passes_is_dominated():
    b = Bracket(Candidate(1, 1, 0, 512), start=4.0)
    b.record(fake_probe(2.5, False))
    assert b.next_factor(0.1, rival=2.0) == 2.0        # could still beat 2.0
    b.record(fake_probe(2.0, False))
    assert b.next_factor(0.1, rival=2.0) is None and b.status is Status.DOMINATED


def test_the_found_rate_passes_and_the_next_step_up_fails(files):
    cfg, trace = files
    slo = Slo(TTFT, TPOT)
    tr = read_trace(trace)
    res = make_plan(load_config(cfg), tr, Settings(slo, 0.9, 2, (512,), 0.1),
                    InProcess(tr, slo, 0.9), progress=False)
    best = res.best
    assert best.status is Status.CONVERGED
    assert best.lo.passed and best.lo.attainment >= 0.9 and not best.lo.stopped_early
    assert not best.hi.passed and best.hi.attainment < 0.9
    assert best.lo.factor < best.hi.factor <= best.lo.factor * 1.1
    # every probe of every candidate sits on the right side of its bracket
    for b in res.brackets:
        for p in b.probes:
            assert p.passed == (b.lo is not None and p.factor <= b.lo.factor)


class _Tasks:
    """A task runner with RayTasks' surface that runs each call here, later,
    on a copy of what was put (as Ray's object store would hand it back)."""

    width = 3

    def __init__(self):
        self.stored, self.calls, self.closed = [], 0, False

    def put(self, value):
        import copy

        self.stored.append(copy.deepcopy(value))
        return len(self.stored) - 1

    def submit(self, fn, *args):
        self.calls += 1
        return fn, args

    def result(self, handle):
        fn, (cfg, ref, *rest) = handle
        return fn(cfg, self.stored[ref], *rest)

    def close(self):
        self.closed = True


def test_probes_on_a_task_runner_find_what_in_process_probes_find(files):
    """The pool `pdserve plan` runs on Ray stores the trace once and submits
    each probe as a call: the plan is the one the in-process pool finds."""
    cfg, trace = files
    slo = Slo(TTFT, TPOT)
    tr = read_trace(trace)
    settings = Settings(slo, 0.9, 2, (512,), 0.1)
    here = make_plan(load_config(cfg), tr, settings, InProcess(tr, slo, 0.9), progress=False)
    tasks = _Tasks()
    pool = OnTasks(tasks, tr, slo, 0.9)
    there = make_plan(load_config(cfg), tr, settings, pool, progress=False)
    pool.close()
    assert len(tasks.stored) == 1 and tasks.calls == sum(len(b.probes) for b in there.brackets)
    assert tasks.closed and pool.width == 3
    assert [(b.candidate, b.lo and b.lo.factor, b.hi and b.hi.factor) for b in there.brackets] \
        == [(b.candidate, b.lo and b.lo.factor, b.hi and b.hi.factor) for b in here.brackets]


def test_a_watched_run_stops_once_attainment_is_out_of_reach_and_is_otherwise_unchanged(files):
    cfg, trace = files
    base = load_config(cfg)
    slo = Slo(TTFT, TPOT)
    tr = read_trace(trace)
    calm = scale_arrivals(tr, 0.5)
    watch = SloWatch(slo, 0.9, len(tr))
    assert Simulation(base, calm, progress=False, watch=watch).run() == \
        Simulation(base, calm, progress=False).run()
    assert not watch.hopeless
    storm = scale_arrivals(tr, 100.0)
    watch = SloWatch(slo, 0.9, len(tr))
    res = Simulation(base, storm, progress=False, watch=watch).run()
    assert watch.hopeless and len(watch.missed) == watch.budget + 1
    assert res["summary"]["unfinished"] > 0            # it did not play the trace out
    met = sum(1 for r in Simulation(base, storm, progress=False).run()["requests"]
              if slo.met(r))
    assert met < watch.need                            # and the full run does fail


def test_plan_yaml_loads_and_names_the_best_candidate(files, tmp_path, capsys):
    cfg, trace = files
    assert plan_cli(cfg, trace, tmp_path / "out", "--in-process") == 0
    printed = capsys.readouterr().out
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    best = plan["best"]
    loaded = load_config(tmp_path / "out" / "plan.yaml")
    assert (loaded.cluster.prefill, loaded.cluster.decode, loaded.cluster.fused) == \
        (best["prefill"], best["decode"], best["fused"])
    assert loaded.engine.max_scheduled_tokens == best["chunk"]
    assert loaded.engine.total_pages == 2048 and loaded.simulate.model == "llama-3-8b"
    assert plan["candidates"][0]["shape"] == best["shape"]
    assert len(plan["candidates"]) == 3 * 2            # fused x3, 1P+2D, 2P+1D x 2 chunks
    assert f"best: {best['shape']}, chunk {best['chunk']}" in printed
    assert main(["sim", "--config", str(tmp_path / "out" / "plan.yaml"), "--trace", str(trace),
                 "--out", str(tmp_path / "sim.json"), "--no-progress"]) == 0
    png = tmp_path / "out" / "plan.png"
    assert (png.is_file() and png.stat().st_size > 0) or "matplotlib is not installed" in printed


def test_two_runs_write_the_same_plan_whatever_runs_the_probes(files, tmp_path):
    """In-process, one probe after another, and on Ray, where probes finish
    in any order: the same files."""
    cfg, trace = files
    small = ["--gpus", "2", "--chunks", "512", "--cpus", "2"]    # 2 candidates
    assert plan_cli(cfg, trace, tmp_path / "a", "--in-process", *small) == 0
    assert plan_cli(cfg, trace, tmp_path / "b", "--in-process", *small) == 0
    assert plan_cli(cfg, trace, tmp_path / "ray", *small) == 0
    for name in ("plan.json", "plan.yaml"):
        text = (tmp_path / "a" / name).read_text()
        assert (tmp_path / "b" / name).read_text() == text
        assert (tmp_path / "ray" / name).read_text() == text


@pytest.mark.parametrize("flags,words", [
    (["--ttft", "0"], ["--ttft must be a positive number", "e.g. --ttft"]),
    (["--tpot", "-0.1"], ["--tpot must be a positive number"]),
    (["--tpot", "nan"], ["--tpot must be a positive number"]),
    (["--attainment", "1.5"], ["--attainment must be in (0, 1]"]),
    (["--gpus", "0"], ["--gpus must be at least 1"]),
    (["--chunks", "8"], ["--chunks 8 is below engine.page_size=16"]),
    (["--limit", "0"], ["--limit must be at least 1"]),
    (["--prompt-len", "0"], ["--prompt-len 0 must be at least 1"]),
    (["--trace", "/nonexistent/trace.jsonl"], ["does not exist", "pass --trace"]),
    (["--config", "/nonexistent/base.yaml"], ["does not exist", "--config"]),
])
def test_inputs_that_cannot_be_planned_say_what_to_change(files, tmp_path, capsys, flags,
                                                           words):
    cfg, trace = files
    args = {"--config": str(cfg), "--trace": str(trace), "--ttft": "1", "--tpot": "0.05",
            "--gpus": "2", "--out": str(tmp_path / "out")}
    extra = []
    for k, v in zip(flags[::2], flags[1::2]):
        if k in args:
            args[k] = v
        else:
            extra += [k, v]
    argv = ["plan", "--in-process", "--no-progress"] + [x for kv in args.items() for x in kv]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err
    assert not (tmp_path / "out").exists()


def plan_one_gpu(files, out, ttft):
    """One engine, one chunk, the first 10 requests."""
    cfg, trace = files
    return main(["plan", "--config", str(cfg), "--trace", str(trace), "--ttft", str(ttft),
                 "--tpot", "0.05", "--gpus", "1", "--chunks", "512", "--out", str(out),
                 "--in-process", "--no-progress", "--limit", "10"])


def test_one_gpu_searches_only_the_chunk_of_one_fused_engine(files, tmp_path, capsys):
    assert plan_one_gpu(files, tmp_path / "out", ttft=1) == 0
    assert "--gpus 1 allows only one fused engine" in capsys.readouterr().err
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert [c["shape"] for c in plan["candidates"]] == ["fused x1"]


def test_an_slo_no_candidate_can_meet_is_an_error_with_the_closest_result(files, tmp_path,
                                                                          capsys):
    assert plan_one_gpu(files, tmp_path / "out", ttft=0.001) == 1
    err = capsys.readouterr().err
    assert "no candidate met the SLO" in err and "loosen --ttft/--tpot" in err
    assert not (tmp_path / "out" / "plan.yaml").exists()
    assert math.isfinite(json.loads((tmp_path / "out" / "plan.json").read_text())
                         ["native_rate_req_s"])


# ---- where P/D beats fused: several TPOT SLOs and prompt lengths ------------------

def _bracket(shape: tuple, factor: float | None) -> Bracket:
    b = Bracket(Candidate(*shape, 512), 1.0)
    if factor is not None:
        b.record(Probe(factor, factor, True, 1.0, False, 1, None, None, None, None))
    return b


@pytest.mark.parametrize("fused,split,winner", [
    (1.0, 1.5, "P/D"), (1.5, 1.0, "fused"), (1.0, 1.05, "tie"), (None, 1.0, "P/D"),
    (1.0, None, "fused"), (None, None, "neither")])
def test_a_map_cell_names_the_winner_beyond_the_searches_tolerance(fused, split, winner):
    from pdserve.sim.plan.map import Cell

    cell = Cell(1024, 0.05, _bracket((0, 0, 2), fused), _bracket((1, 1, 0), split), 0.1)
    assert cell.winner.value == winner
    assert cell.ratio == (None if not fused else (split or 0.0) / fused)


def test_cutting_prompts_keeps_the_blocks_they_still_reach(files):
    from pdserve.sim.plan.map import cut_prompts

    _, trace = files
    full = read_trace(str(trace))
    cut = cut_prompts(full, 600)
    assert [len(t.prompt) for t in cut] == [min(len(t.prompt), 600) for t in full]
    long = next(i for i, t in enumerate(full) if len(t.prompt) > 600)
    assert cut[long].prompt.hash_ids == full[long].prompt.hash_ids[:2]   # 512-token blocks
    assert [t.arrival_s for t in cut] == [t.arrival_s for t in full]


def test_the_map_runs_each_cell_as_its_own_fused_and_split_searches(files, tmp_path, capsys):
    """Two TPOT SLOs x two prompt lengths on 2 GPUs: each cell's goodputs
    are what a plan over the fused candidates alone and over the splits
    alone find on those prompts at that SLO; a looser TPOT or shorter
    prompts never lower them."""
    from pdserve.sim.plan.map import cut_prompts

    cfg, trace = files
    assert main(["plan", "--config", str(cfg), "--trace", str(trace), "--ttft", str(TTFT),
                 "--tpot", "0.03", "0.1", "--prompt-len", "400", "1500", "--gpus", "2",
                 "--chunks", "512", "--out", str(tmp_path / "out"), "--in-process",
                 "--no-progress"]) == 0
    cells = json.loads((tmp_path / "out" / "map.json").read_text())["cells"]
    assert [(c["prompt_len"], c["tpot_s"]) for c in cells] == \
        [(400, 0.03), (400, 0.1), (1500, 0.03), (1500, 0.1)]
    base, full = load_config(cfg), read_trace(str(trace))
    settings = Settings(Slo(TTFT, 0.1), gpus=2, chunks=(512,))
    cut = cut_prompts(full, 400)
    for split, key in ((False, "fused"), (True, "split")):
        alone = make_plan(base, cut, settings, InProcess(cut, settings.slo, 0.9),
                          progress=False, disaggregated=split).ranked()[0]
        assert cells[1][key]["goodput_req_s"] == alone.lo.rate_req_s
        assert cells[1][key]["shape"] == ("1P+1D" if split else "fused x2")
    # the trace's prompts run to 1,500 tokens: cut at 400 they are served faster
    assert cells[1]["fused"]["goodput_req_s"] > cells[3]["fused"]["goodput_req_s"]
    tol = 1.1
    for key in ("fused", "split"):
        good = {(c["prompt_len"], c["tpot_s"]): c[key]["goodput_req_s"] for c in cells}
        assert good[(400, 0.1)] * tol >= good[(400, 0.03)]
        assert good[(1500, 0.1)] * tol >= good[(1500, 0.03)]
        assert good[(400, 0.1)] * tol >= good[(1500, 0.1)]
    table = (tmp_path / "out" / "map.md").read_text()
    assert table.splitlines()[0] == "| prompts | TPOT <= 30 ms | TPOT <= 100 ms |"
    assert "| cut at 1,500 |" in table and table in capsys.readouterr().out + "\n"


def test_a_map_needs_a_gpu_count_that_allows_a_split(files, tmp_path, capsys):
    cfg, trace = files
    assert main(["plan", "--config", str(cfg), "--trace", str(trace), "--ttft", "1",
                 "--tpot", "0.05", "0.1", "--gpus", "1", "--out", str(tmp_path / "out"),
                 "--in-process", "--no-progress"]) == 2
    assert "give --gpus 2 or more" in capsys.readouterr().err
