"""`engine.cpu_threads`: how many torch threads a CPU engine runs (Ray alone
gives it one, OMP_NUM_THREADS=1, in an actor that takes no CPUs)."""

import pytest

from pdserve.cluster.cpu_threads import ENV, engine_threads, served_threads, thread_env
from pdserve.config import ConfigError, ServeConfig


def config(cluster, **engine) -> ServeConfig:
    return ServeConfig.from_dict({"cluster": cluster, "engine": engine})


def test_auto_runs_one_thread_as_ray_gave_engines():
    assert engine_threads(config({"fused": 1}), "fused") == 1
    assert engine_threads(config({"prefill": 1, "decode": 1}), "decode") == 1


def test_a_number_in_the_config_is_taken_as_it_is():
    assert engine_threads(config({"fused": 2}, cpu_threads=3), "fused") == 3


def test_the_engine_process_is_started_with_the_count(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert thread_env(config({"fused": 1}, cpu_threads=2), "fused") == {ENV: "2"}
    assert thread_env(config({"fused": 1}), "fused") == {ENV: "1"}


def test_the_drivers_own_omp_num_threads_wins(monkeypatch):
    cfg = config({"fused": 1}, cpu_threads=3)
    monkeypatch.setenv(ENV, "5")
    assert thread_env(cfg, "fused") == {}            # the process inherits the driver's
    assert served_threads(cfg, "fused") == 5
    monkeypatch.delenv(ENV)
    assert served_threads(cfg, "fused") == 3


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_cpu_threads_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="engine.cpu_threads must be an integer >= 0"):
        config({"fused": 1}, cpu_threads=bad)
