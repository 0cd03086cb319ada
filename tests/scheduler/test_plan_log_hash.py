"""The planner's plans, byte for byte, on seeded workloads.

Each case runs the simulator with a plan log (`pdserve sim --plans`) and
compares the sha256 of the log's JSON lines, and of a page-level account of
every plan (which pages each chunk, store and load names, and what each
pool has free), with hashes recorded from the code before a refactor of
`scheduler/`. A change that moves one page or one op changes a hash.

The planner is pure and deterministic (STYLE §3), so these hold on every
machine and under every PYTHONHASHSEED. If a change is meant to change
plans, rerun with PDSERVE_PRINT_PLAN_HASHES=1 and record the new hashes in
the same commit, saying why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from pdserve.cli.main import main
from pdserve.config import ClusterShape, ServeConfig, SimulateConfig, load_config
from pdserve.scheduler import EngineConfig
from pdserve.scheduler.request import BlockPrompt
from pdserve.sim.simulation import Simulation
from pdserve.sim.trace import TraceRequest, read_trace

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DEMO_TRACE = DEPLOY / "demo-trace.jsonl"
# relative to the working directory, as the benchmarks read it: tests run from the root
MOONCAKE = Path("../shared/data/traces/mooncake/conversation_trace.jsonl")
PRINT = os.environ.get("PDSERVE_PRINT_PLAN_HASHES") == "1"


# ---- workloads ---------------------------------------------------------------

def _mooncake(n: int, max_output: int) -> list[TraceRequest]:
    """The first n Mooncake conversations, outputs capped so the case stays
    a few seconds long (retraction still needs decode growth)."""
    if not MOONCAKE.is_file():
        pytest.skip(f"{MOONCAKE} is absent (run from the repository root beside ../shared)")
    return [dataclasses.replace(t, max_new_tokens=min(t.max_new_tokens, max_output),
                                output_tokens=min(t.output_tokens, max_output))
            for t in read_trace(MOONCAKE, limit=n)]


def _long_prompts(n: int) -> list[TraceRequest]:
    """Prompts of 3,000 tokens and more, nothing shared (test_sim_groups.py's)."""
    return [TraceRequest(f"g{i}", i * 0.05,
                         BlockPrompt([(-1 - i, b) for b in range(8)], 3000 + 100 * i, 512),
                         60, 60) for i in range(n)]


def _tight(cfg: ServeConfig, shape: ClusterShape, **engine) -> ServeConfig:
    """sim-mooncake-tight.yaml squeezed further: a pool that retracts."""
    return dataclasses.replace(cfg, cluster=shape,
                               engine=dataclasses.replace(cfg.engine, **engine))


FUSED1 = ClusterShape(prefill=0, decode=0, fused=1)
PD = ClusterShape(prefill=1, decode=1, fused=0)


def _groups_config(model: str, shape: ClusterShape, total_pages: int, host_pages: int = 0,
                   sliding_pages: int = 0, safe_steps: int = 8) -> ServeConfig:
    """A preset with cache groups beside full history (sliding windows, or
    a snapshot-state group)."""
    engine = EngineConfig(page_size=16, total_pages=total_pages, sliding_pages=sliding_pages,
                          host_pages=host_pages, max_scheduled_tokens=2048,
                          safe_steps=safe_steps)
    return ServeConfig(engine=engine, cluster=shape,
                       simulate=SimulateConfig(gpu="h100", model=model, sliding_groups=True))


def _mooncake_tight():
    return load_config(DEPLOY / "sim-mooncake-tight.yaml")


# name -> (config, trace) makers
WORKLOADS = {
    # the shipped tight config, a quarter of its pool on one engine, with a host tier
    "mooncake-tight-host": lambda: (
        _tight(_mooncake_tight(), FUSED1, total_pages=1024, host_pages=4096, safe_steps=1),
        _mooncake(300, 256)),
    # without a host tier: a victim goes back to waiting and re-prefills
    "mooncake-tight-requeue": lambda: (
        _tight(_mooncake_tight(), FUSED1, total_pages=768, safe_steps=1),
        _mooncake(150, 256)),
    # disaggregated, D retracting to its host tier
    "mooncake-tight-pd-host": lambda: (
        _tight(_mooncake_tight(), PD, total_pages=1024, host_pages=4096, safe_steps=1),
        _mooncake(100, 256)),
    # the full-history pool retracts (a sliding pool admits no newcomer its
    # residents may still grow into, so it no longer overcommits)
    "gemma-sliding": lambda: (
        _groups_config("gemma-3-27b", FUSED1, 384, sliding_pages=400), _long_prompts(10)),
    "gemma-sliding-pd": lambda: (
        _groups_config("gemma-3-27b", PD, 2048, sliding_pages=400), _long_prompts(6)),
    # sliding groups retracting to, and hitting in, the host tier
    "gemma-sliding-host": lambda: (
        _groups_config("gemma-3-27b", FUSED1, 1024, host_pages=4096, sliding_pages=300),
        _mooncake(150, 128)),
    # a snapshot-state group: checkpoints published, stored and loaded
    "qwen3-next-state-host": lambda: (
        _groups_config("qwen3-next-80b", FUSED1, 1024, host_pages=4096), _mooncake(100, 128)),
}

# the plan ops each workload must exercise, or its hash guards less than it claims
MUST_HAVE = {
    "mooncake-tight-host": {"retract", "readmit", "store", "load", "prefill", "decode"},
    "mooncake-tight-requeue": {"retract", "prefill", "decode"},
    "mooncake-tight-pd-host": {"retract", "readmit", "store", "load", "remote_prefill",
                               "remote_decode"},
    "gemma-sliding": {"retract"},
    "gemma-sliding-pd": {"remote_prefill", "remote_decode"},
    "gemma-sliding-host": {"retract", "readmit", "store", "load"},
    "qwen3-next-state-host": {"retract", "readmit", "store", "load"},
}

# (sha256 of the plan log, sha256 of the page account), recorded before the
# scheduler's coordinator and planner were split; the retracting cases
# re-recorded when a victim began to yield to the request it was retracted
# for, again when a load's ticket came to hold its targets (issue 34), and
# the sliding cases when a sliding pool stopped admitting newcomers its
# residents may still grow into (demands.sliding_room); every page account
# re-recorded (the plan logs unchanged) when the pool began to hand out runs
# in ascending page order, so NIXL merges a transfer's runs (pool.py)
HASHES = {
    "sim-demo": ("55da10020e826af685a8f77f3939cfbb43906f59df162bab640d42885e088fb2",
                "8ee869cdf7158958bda22043a7f8eb543c97d5ce7a1934cd45129a1df26d256a"),
    "sim-demo-pd": ("48b2552a931ce6e9baa7ab1ebfca622c5ec8bda729f8b19eff36029fd8b7615b",
                   "d17b7fe928b701555729e14fc9841cabf70cb24c3939384f866b410dc8530168"),
    "mooncake-tight-host": ("ed2babd0ece726819feaf9c1104b5161e3dfa11ec4f2832b23ca8f777acd2f53",
                           "f06cb3d6f41e405ce8c9b5ab890bc99ab02f69554f2befabff41c7ecec297918"),
    "mooncake-tight-requeue": ("a14fb6a39c95236710737f2aaeb64ca444d3cb48e9c827d2708dd83d3abecb53",
                              "2dbc913e3e9c236755f9d91c46d0e37e3e11dfa74b5a10724165cc8397eb605f"),
    "mooncake-tight-pd-host": ("a0c8c5d4ba16012305722df4d52b4ca83547219adbe7d6f0bdaf7fabba7f2872",
                              "b67008530eb69190b2d76ac951a218fb54900020f1d82c131403b1176d260bfd"),
    "gemma-sliding": ("2936334e50261142dd8f41c8b7d0d20ca70d6b81fc3bf2b3a54c1ffffbd22443",
                     "5f32de1847aedad2c57824c2cee561a56cead97926f47d1c8a43dc4736caa167"),
    "gemma-sliding-pd": ("49928aaee5d27036a0fc4f38939b32a0def4d1767bf4708472e30bab155351a9",
                        "5c00083454f9399809a0b56e0c85b5520462cca8de15005f36c908235bd5ebbf"),
    "gemma-sliding-host": ("d727614455a035037fa6b9fb9b1338ce5f3b6cc896868bf7cb5627699ee69cfd",
                          "faa36b591cc479c40e9f1437161f69f3e70554a4223f1b3ba5ca618626cc03db"),
    "qwen3-next-state-host": ("b33060e7d8071a378d2800591342953e76056fe79cf3998011205bceee60f594",
                             "c2805463c95846a61fe84bbcf86a8f7d1be28f6ae4d13255ee7d2c92a5fde44d"),
}


# ---- the page account ------------------------------------------------------------

def _tables(req) -> list:
    st = req.state
    return st.res.tables if st.holds_pages else []


def _account(pl, plan) -> tuple:
    """Every page a plan names, and what each pool has free as it runs. A
    decode names only its table lengths and last pages (its earlier slots
    were named by the chunks that filled them)."""
    coord = pl.coord
    return (
        plan.round, plan.fresh_pages,
        [(o.req.id, o.begin, o.tokens, o.completes, o.replay, _tables(o.req))
         for o in plan.prefills],
        [(r.id, [(len(t), t[-1] if t else None) for t in _tables(r)]) for r in plan.decodes],
        [(r.req.id, r.stored) for r in plan.retracts],
        [r.id for r in plan.readmits],
        [(s.id, s.req_id, s.device_pages, s.host_pages, s.pinned, s.pins, s.group)
         for s in plan.stores],
        [(ld.id, ld.req_id, ld.host_pages, ld.device_pages, ld.group) for ld in plan.loads],
        [(o.req.id, o.first_page, o.landing) for o in plan.remote_prefills],
        [(o.req.id, o.src, o.first_token) for o in plan.remote_decodes],
        [(g.pool.num_free, g.index.num_idle) for g in coord.groups],
        [(h.pool.num_free, h.index.num_idle) for h in coord.hosts],
    )


def _watch(sim: Simulation):
    """A running sha256 over the page account of every plan any engine runs."""
    digest = hashlib.sha256()
    for se in sim.engines:
        run, pl = se.engine.executor.run, se.planner

        def spy(plan, run=run, pl=pl, name=se.name):
            digest.update(repr((name, _account(pl, plan))).encode())
            return run(plan)
        se.engine.executor.run = spy
    return digest


def _ops(log: str) -> Counter:
    return Counter(op["op"] for line in log.splitlines() for op in json.loads(line)["ops"])


def _check(name: str, log: str, pages: str) -> None:
    got = (hashlib.sha256(log.encode()).hexdigest(), pages)
    if PRINT:
        print(f"\n    {name!r}: {got!r},  # {dict(_ops(log))}")
    assert got == HASHES[name], f"{name}: the plans changed"


# ---- the cases -----------------------------------------------------------------

@pytest.mark.parametrize("config", ["sim-demo", "sim-demo-pd"])
def test_pdserve_sim_writes_the_recorded_plan_log_for_a_shipped_demo(config, tmp_path,
                                                                     monkeypatch):
    """Through the CLI, as a user runs it: the log file's bytes are the record."""
    sims = []
    real = Simulation.__init__

    def keep(self, *a, **kw):
        real(self, *a, **kw)
        sims.append((self, _watch(self)))
    monkeypatch.setattr(Simulation, "__init__", keep)
    plans = tmp_path / "plans.jsonl"
    code = main(["sim", "--config", str(DEPLOY / f"{config}.yaml"), "--trace", str(DEMO_TRACE),
                 "--out", str(tmp_path / "out.json"), "--plans", str(plans), "--no-progress"])
    assert code == 0
    ((sim, pages),) = sims
    assert {se.role.value for se in sim.engines} == \
        ({"fused"} if config == "sim-demo" else {"prefill", "decode"})
    _check(config, plans.read_text(), pages.hexdigest())


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_the_planner_makes_the_recorded_plans(name):
    """Retraction, the host tier, P/D, sliding windows and a state group:
    every op a refactor of scheduler/ could move is in one of these logs."""
    cfg, trace = WORKLOADS[name]()
    log = io.StringIO()
    sim = Simulation(cfg, trace, plan_log=log, progress=False)
    pages = _watch(sim)
    sim.run()
    missing = MUST_HAVE[name] - set(_ops(log.getvalue()))
    assert not missing, f"{name} no longer exercises {sorted(missing)}"
    for se in sim.engines:
        se.planner.assert_idle()
    _check(name, log.getvalue(), pages.hexdigest())
