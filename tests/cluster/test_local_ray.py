"""init_local: a local Ray whose node times out at startup is started
again (up to STARTUP_TRIES starts), after the processes the failed start
left are killed."""

import subprocess
import sys

import psutil
import pytest
import ray

from pdserve.cluster import local_ray

TIMEOUT = Exception("The current node timed out during startup. This could happen because "
                    "some of the raylet failed to startup or the GCS has become overloaded.")


def test_a_startup_timeout_kills_what_the_try_left_and_tries_once_more(monkeypatch, capsys):
    left: list[subprocess.Popen] = []
    calls: list[dict] = []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:      # a failed start leaves a process of its own behind
            left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise TIMEOUT

    monkeypatch.setattr(ray, "init", init)
    local_ray.init_local(num_cpus=2, include_dashboard=False)
    assert calls == [{"num_cpus": 2, "include_dashboard": False}] * 2
    assert not psutil.pid_exists(left[0].pid)       # killed and reaped, not left its minute
    assert "timed out at startup" in capsys.readouterr().err


def test_a_gcs_late_with_its_port_is_a_startup_timeout_too():
    """CI saw the GCS miss Ray's wait for its port file on a busy host."""
    assert local_ray.timed_out_at_startup(RuntimeError(
        "Timed out waiting for file /tmp/ray/session_2026-12-01_12-39-43_057779_12568/"
        "gcs_server_port_19f77e9096d3b5f4"))
    assert not local_ray.timed_out_at_startup(RuntimeError("Timed out waiting for file x.log"))
    assert not local_ray.timed_out_at_startup(ValueError("num_cpus must be positive"))


def test_the_last_timeout_and_any_other_error_reach_the_caller(monkeypatch):
    calls = []

    def timing_out(**kwargs):
        calls.append(kwargs)
        raise TIMEOUT

    monkeypatch.setattr(ray, "init", timing_out)
    with pytest.raises(Exception, match="timed out during startup"):
        local_ray.init_local(num_cpus=1)
    assert len(calls) == local_ray.STARTUP_TRIES

    def refusing(**kwargs):
        calls.append(kwargs)
        raise ValueError("num_cpus must be positive")

    calls.clear()
    monkeypatch.setattr(ray, "init", refusing)
    with pytest.raises(ValueError, match="num_cpus"):
        local_ray.init_local(num_cpus=-1)
    assert len(calls) == 1
