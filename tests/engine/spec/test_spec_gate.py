"""The speculation gate (engine/spec/gate.py): a cost-model prior picks a
batch bucket's first side, measured tokens per CPU second with speculation
against without it decide after that, and spaced probes see a regime
change. Measurements are injected (synthetic costs), so every decision here
is deterministic."""

from __future__ import annotations

import random

from pdserve import LLM, SamplingParams
from pdserve.engine.spec.gate import GateMode, SpecGate, bucket, prior_gain


class Host:
    """A synthetic engine: a forward of r rows costs `fixed + r` CPU
    milliseconds (fixed: reading the weights; large at batch 1 on a
    bandwidth-bound device, 0 on a compute-bound one), a verify row scores
    1 + k rows and gives `acceptance` tokens. Proposals follow the gate one
    round late, as in the executor: a round verifies when the gate was on
    after the round before it was decided."""

    def __init__(self, gate: SpecGate, k: int = 3, seed: int = 0):
        self.gate, self.k = gate, k
        self.pending = gate.on          # candidates proposed after the last round
        self.rng = random.Random(seed)
        self.sides: list = []           # the side of each round run
        self.measured = 0.0             # the engine's mean acceptance length (0: no verify yet)

    def run(self, rounds: int, batch: int, fixed: float, acceptance: float,
            noise: float = 0.0, wall_noise: float = 0.0) -> list:
        for _ in range(rounds):
            spec = self.pending
            self.pending = self.gate.on
            rows = batch * (1 + self.k) if spec else batch
            tokens = round(batch * acceptance) if spec else batch
            cpu = 1e-3 * (fixed + rows) * (1 + self.rng.uniform(-noise, noise))
            wall = cpu * (1 + self.rng.uniform(0, wall_noise))   # other processes' load
            self.gate.observe(spec, batch, tokens, wall, cpu, self.measured)
            if spec:
                self.measured = acceptance
            self.sides.append(spec)
        return self.sides[-rounds:]


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 7, 8, 16, 31)] == [1, 2, 2, 4, 4, 8, 16, 16]


def test_the_prior_prices_a_verify_by_its_extra_rows():
    # batch 1: the forward's fixed cost dominates and the extra rows are nearly free
    assert prior_gain(1, k=3, acceptance=2.5, free_rows=4) > 1.5
    # batch 16: 64 rows where a decode has 16; 2.5 tokens a row do not pay for them
    assert prior_gain(16, k=3, acceptance=2.5, free_rows=4) < 0.8


def test_compute_bound_starts_off_and_stays_off():
    """A large batch on a compute-bound host: the prior starts speculation
    off, the probes confirm it, and they get rarer, so the on-rounds paid
    for measuring stay a few percent."""
    gate = SpecGate(k=3)
    host = Host(gate)
    sides = host.run(1000, batch=32, fixed=0, acceptance=3.0, noise=0.1)
    assert not gate.on and gate.switches == 0
    assert sum(sides) / len(sides) < 0.04
    st = gate.buckets[32]
    assert st.prior < gate.prior_sure and not any(sides[2:4 * gate.probe_first])  # 2: in flight
    assert st.interval == gate.probe_max          # every probe confirmed the choice
    on, off = gate.rates()
    assert 0 < on < off


def test_batch_one_starts_on_and_stays_on():
    gate = SpecGate(k=3)
    host = Host(gate)
    sides = host.run(1000, batch=1, fixed=50, acceptance=3.0, noise=0.1)
    assert gate.on and gate.switches == 0
    assert sum(sides) / len(sides) > 0.96


def test_a_wrong_prior_is_corrected_by_the_first_probe():
    """Candidates that are never right: the prior's default acceptance says
    on at batch 1, the measurement says off."""
    gate = SpecGate(k=3)
    Host(gate).run(gate.probe_first + 2 * gate.probe_rounds + 4, batch=1, fixed=2,
                   acceptance=1.0)
    assert not gate.on and gate.switches == 1


def test_a_regime_change_flips_the_gate_back_within_a_probe_interval():
    gate = SpecGate(k=3)
    host = Host(gate)
    host.run(2000, batch=16, fixed=0, acceptance=3.0)       # compute-bound: off
    assert not gate.on
    # the same batch now pays (a bandwidth-bound forward, or a near-perfect
    # proposer): the next probe sees it, at most probe_max rounds away
    within = gate.probe_max + 2 * gate.probe_rounds + 2
    sides = host.run(within, batch=16, fixed=400, acceptance=4.0)
    assert gate.on and gate.switches == 1
    assert all(sides[-3:])


def test_noise_does_not_flap_the_gate():
    """Speculation 20% ahead, each round's cost off by up to 25% either
    way: the gate stays on, and with the sides equal it switches rarely."""
    gate = SpecGate(k=3)
    Host(gate, seed=1).run(3000, batch=4, fixed=6.4, acceptance=2.0, noise=0.25)
    # on: 2 x 4 tokens for 6.4 + 16 ms, off: 4 for 10.4 ms -> 0.357 vs 0.385 (off ahead 8%)
    assert not gate.on and gate.switches <= 1
    gate = SpecGate(k=3)
    Host(gate, seed=2).run(3000, batch=4, fixed=8, acceptance=2.0, noise=0.25)
    # on: 8 tokens for 24 ms, off: 4 for 12 ms -> equal
    assert gate.switches <= 4                     # a few in 3000 rounds, each free


def test_cpu_time_decides_where_wall_time_is_the_hosts_load():
    """Wall time inflated by up to 5x at random (other processes' load),
    CPU time clean: the gate follows CPU time."""
    gate = SpecGate(k=3)
    Host(gate, seed=3).run(1000, batch=16, fixed=0, acceptance=3.0, wall_noise=4.0)
    assert not gate.on and gate.switches == 0
    gate = SpecGate(k=3)
    Host(gate, seed=4).run(1000, batch=1, fixed=50, acceptance=3.0, wall_noise=4.0)
    assert gate.on and gate.switches == 0


def test_the_prior_uses_the_measured_acceptance():
    """A bucket first seen after verifies measured a high acceptance starts on."""
    gate = SpecGate(k=3)
    gate.observe(False, 8, 8, 0.01, 0.01, acceptance=0.0)        # default 2.5: off at 8
    assert not gate.buckets[8].chosen
    gate.observe(False, 4, 4, 0.01, 0.01, acceptance=4.0)
    assert gate.buckets[4].chosen and gate.on


def test_each_batch_bucket_decides_for_itself():
    gate = SpecGate(k=3)
    host = Host(gate)
    host.run(50, batch=1, fixed=50, acceptance=3.0)
    host.run(50, batch=32, fixed=0, acceptance=3.0)
    assert not gate.on
    host.run(2, batch=1, fixed=50, acceptance=3.0)
    assert gate.on                                    # back at batch 1: it pays there


def test_the_log_keeps_each_round_seen():
    gate = SpecGate(k=3, log_limit=10)
    Host(gate).run(12, batch=2, fixed=4, acceptance=2.0)
    log = gate.take_log()
    assert len(log) == 10 and [r.index for r in log] == list(range(2, 12))
    assert all(r.batch == 2 and r.cpu_s is not None and r.cpu_s > 0 for r in log)
    assert isinstance(log[-1].mode, GateMode)
    assert gate.take_log() == []


def test_an_engine_whose_gate_is_off_proposes_nothing():
    llm = LLM(speculative={"num_speculative_tokens": 3, "prompt_lookup_min": 1})
    gate = llm.executor.spec.gate
    assert gate is not None
    Host(gate).run(60, batch=1, fixed=1, acceptance=1.0)        # as measured elsewhere
    assert not gate.on
    before = llm.executor.spec.counts.drafts
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 5, 6, 5, 6]], sp, use_tqdm=False)
    assert llm.executor.spec.counts.drafts == before


def test_the_bench_summarizes_the_log_by_bucket():
    """`pdserve bench spec` prints the gate's rounds per bucket: rounds and
    tokens per CPU second a side, probes begun, switches of the chosen side."""
    from pdserve.benchmarks.spec.gate_log import summarize

    gate = SpecGate(k=3)
    host = Host(gate)
    host.run(300, batch=32, fixed=0, acceptance=3.0)
    host.run(200, batch=2, fixed=50, acceptance=1.0)       # on by the prior, then off
    by = {s.bucket: s for s in summarize(gate.take_log())}
    assert set(by) == {2, 32}
    big, two = by[32], by[2]
    assert big.rounds[True] + big.rounds[False] == 300
    assert big.probes == 1 and big.switches == 0 and big.end is GateMode.OFF
    assert big.rate(False) > big.rate(True) > 0
    assert two.switches == 1 and two.end is GateMode.OFF
