"""The speculation gate (roles/spec_gate.py): measured delivered tokens/s
with speculation against without it, at the batch running, decide whether
an engine proposes; measurements are injected, so every decision here is
deterministic."""

from __future__ import annotations

from pdserve import LLM, SamplingParams
from pdserve.roles.spec_gate import GateMode, SpecGate, bucket


def feed(gate: SpecGate, batch: int, rate_on: float, rate_off: float, rounds: int) -> list:
    """`rounds` decode rounds at `batch`, each delivering what the side the
    gate is on delivers there; the modes it went through."""
    modes = []
    for _ in range(rounds):
        on = gate.on
        gate.observe(on, batch, int((rate_on if on else rate_off) / 100), 0.01)
        modes.append(gate.mode)
    return modes


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 7, 8, 16, 31)] == [1, 2, 2, 4, 4, 8, 16, 16]


def test_it_measures_both_sides_then_keeps_speculation_where_it_pays():
    gate = SpecGate(probe_every=1000, probe_rounds=4)
    modes = feed(gate, 1, rate_on=300, rate_off=100, rounds=20)
    assert GateMode.PROBE_OFF in modes[:8]          # the side it was not on, measured
    assert gate.mode is GateMode.ON and gate.on
    on, off = gate.rates()
    assert on == 300 and off == 100


def test_it_turns_speculation_off_where_it_costs_and_back_on_when_it_pays():
    gate = SpecGate(probe_every=50, probe_rounds=4)
    feed(gate, 16, rate_on=800, rate_off=1000, rounds=20)
    assert gate.mode is GateMode.OFF and not gate.on and gate.switches == 1
    # the workload changes: speculation pays again; a probe sees it
    modes = feed(gate, 16, rate_on=2000, rate_off=1000, rounds=120)
    assert GateMode.PROBE_ON in modes
    assert gate.mode is GateMode.ON and gate.switches == 2


def test_a_small_difference_does_not_flap():
    gate = SpecGate(probe_every=1000, probe_rounds=4, margin=0.05)
    feed(gate, 4, rate_on=1000, rate_off=1010, rounds=40)
    assert gate.mode is GateMode.ON and gate.switches == 0


def test_each_batch_bucket_decides_for_itself():
    gate = SpecGate(probe_every=1000, probe_rounds=4)
    feed(gate, 1, rate_on=300, rate_off=100, rounds=12)
    feed(gate, 32, rate_on=500, rate_off=900, rounds=12)
    assert not gate.on
    feed(gate, 1, rate_on=300, rate_off=100, rounds=1)
    assert gate.on                                    # back at batch 1: it pays there


def test_an_engine_whose_gate_is_off_proposes_nothing():
    llm = LLM(speculative={"num_speculative_tokens": 3, "prompt_lookup_min": 1})
    gate = llm.executor.spec.gate
    assert gate is not None
    feed(gate, 1, rate_on=100, rate_off=300, rounds=30)     # as measured elsewhere
    assert not gate.on
    before = llm.executor.spec.counts.drafts
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 5, 6, 5, 6]], sp, use_tqdm=False)
    assert llm.executor.spec.counts.drafts == before
