"""The soak, bounded: mixed traffic at concurrency 32 with random faults at
every transfer stage, client aborts and a prefill engine killed mid-run;
zero leaks and every greedy answer equal to the offline engine's."""

import pytest

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def test_soak_survives_faults_aborts_and_a_killed_engine_with_zero_leaks():
    from pdserve.benchmarks.soak import main

    assert main(seconds=20.0, concurrency=32, seed=3) == 0
