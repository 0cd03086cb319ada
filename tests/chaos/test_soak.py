"""The soak, bounded: mixed traffic at concurrency 32 with random faults at
every transfer stage, client aborts and a prefill engine killed mid-run;
zero leaks, nothing refused, every greedy answer equal to the offline
engine's. Its PASS rule is checked on its own, without a cluster."""

import pytest

from pdserve.benchmarks.serving.soak import FAULT_KINDS, fault_rules, verdict
from pdserve.transfer.faults import FaultInjector

GOOD = dict(counts={"requests": 10, "finished": 8, "matched_reference": 8, "aborts_issued": 2,
                    "aborts_too_late": 1, "aborted_by_client": 2, "refused_or_failed": 0},
            hung=0, worker_errors=[], leaks=[], fired={k: 1 for k in FAULT_KINDS})


def run_verdict(**change):
    kw = {**GOOD, **change}
    if "counts" in change:
        kw["counts"] = {**GOOD["counts"], **change["counts"]}
    return {what for what, ok in verdict(**kw).items() if not ok}


def test_a_clean_run_passes():
    assert run_verdict() == set()


@pytest.mark.parametrize("change,failed", [
    ({"counts": {"refused_or_failed": 1}}, "nothing refused or failed"),
    ({"counts": {"finished": 0, "matched_reference": 0}}, "something finished"),
    ({"counts": {"matched_reference": 7}}, "every finished answer matched"),
    ({"counts": {"aborted_by_client": 1}}, "aborts issued == streams ended ABORTED"),
    ({"counts": {"aborted_by_client": 3}}, "aborts issued == streams ended ABORTED"),
    ({"fired": {k: 1 for k in FAULT_KINDS[1:]}}, "every fault kind fired"),
    ({"worker_errors": ["worker 3: KeyError"]}, "no worker thread lost"),
    ({"hung": 1}, "no request hung"),
    ({"leaks": ["decode-0"]}, "every engine idle"),
])
def test_each_condition_alone_fails_the_run(change, failed):
    assert run_verdict(**change) == {failed}


def test_every_fault_kind_fires_on_the_first_transfer_that_reaches_its_stage():
    for role, stages in (("prefill", ("post", "completion")),
                         ("decode", ("notification", "notification", "ack"))):
        inj = FaultInjector.from_config(fault_rules(role), seed=0)
        for i, stage in enumerate(stages):
            inj.match(stage, f"r{i}")
        assert [f"{s}:{a}" for s, a, _ in inj.fired] == \
            [f"{r['stage']}:{r['action']}" for r in fault_rules(role)[:len(stages)]]


@pytest.mark.chaos
@pytest.mark.slow
def test_soak_survives_faults_aborts_and_a_killed_engine_with_zero_leaks(capsys):
    from pdserve.benchmarks.serving.soak import main

    code = main(seconds=20.0, concurrency=32, seed=3)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "soak: PASS" in out
