"""The autoscaler's policy (cluster/autoscale_policy.py), one observation at a time."""

import pytest

from pdserve.cluster.autoscale_policy import (
    AutoscaleConfig, EngineView, Observation, PolicyState, RoleBounds, decide)
from pdserve.scheduler.config import ConfigError

CFG = AutoscaleConfig(prefill=RoleBounds(1, 2), decode=RoleBounds(1, 2), ttft_s=1.0,
                      itl_s=0.1, cooldown_s=10, scale_down_after_s=30)


def engines(p=1, d=1, d_used=0, p_wait=None, d_wait=None, running=0):
    out = [EngineView(f"prefill-{i}", "prefill", running, 0, 100, dict(p_wait or {}))
           for i in range(p)]
    out += [EngineView(f"decode-{i}", "decode", running, d_used, 100, dict(d_wait or {}))
            for i in range(d)]
    return out


def test_late_first_tokens_add_a_prefill_engine():
    a = decide(CFG, Observation(0, engines(), ttft_p95=2.5, itl_p95=0.05), PolicyState())
    assert (a.kind, a.role) == ("add", "prefill") and "TTFT" in a.why


def test_a_queue_for_prefill_adds_one_before_any_token_is_late():
    """Queue wait counts: Dynamo's planner missed a backlog that had not
    yet shown in the prefill time."""
    obs = Observation(0, engines(d_wait={"waiting_for_prefill": 5}), ttft_p95=0.5)
    assert decide(CFG, obs, PolicyState()).role == "prefill"


def test_slow_tokens_or_full_decode_pages_add_a_decode_engine():
    assert decide(CFG, Observation(0, engines(), itl_p95=0.3), PolicyState()).role == "decode"
    a = decide(CFG, Observation(0, engines(d_used=95)), PolicyState())
    assert (a.kind, a.role) == ("add", "decode") and "95%" in a.why


def test_the_worse_breach_goes_first():
    obs = Observation(0, engines(), ttft_p95=1.2, itl_p95=0.5)      # 1.2x against 5x
    assert decide(CFG, obs, PolicyState()).role == "decode"


def test_one_step_at_a_time_cooldown_pending_and_max():
    state = PolicyState()
    hot = dict(ttft_p95=3.0)
    assert decide(CFG, Observation(0, engines(), **hot), state).kind == "add"
    assert decide(CFG, Observation(5, engines(p=2), **hot), state) is None     # cooldown
    assert decide(CFG, Observation(20, engines(p=2), pending=True, **hot), state) is None
    assert decide(CFG, Observation(20, engines(p=2), **hot), state) is None    # at max


def test_the_cooldown_runs_from_when_an_action_is_done_not_when_it_was_decided():
    """An engine that takes longer to start than the cooldown (weights, a
    new node): the backlog that built up meanwhile is not a second breach
    the look after it joins (that added two engines for one breach)."""
    state = PolicyState()
    cfg = AutoscaleConfig(prefill=RoleBounds(1, 4), decode=RoleBounds(1, 4), ttft_s=1.0,
                          cooldown_s=10)
    hot = dict(ttft_p95=3.0)
    assert decide(cfg, Observation(0, engines(), **hot), state).kind == "add"
    for t in range(5, 95, 5):                                          # still starting
        assert decide(cfg, Observation(t, engines(), pending=True, **hot), state) is None
    assert decide(cfg, Observation(95, engines(p=2), **hot), state) is None
    assert decide(cfg, Observation(105, engines(p=2), **hot), state).kind == "add"


def test_a_role_under_its_minimum_gets_an_engine_back():
    """The last P drained by hand: no request reaches a prefill, so nothing
    breaches, and the deployment stayed down."""
    state = PolicyState()
    a = decide(CFG, Observation(0, engines(p=0)), state)
    assert (a.kind, a.role) == ("add", "prefill") and "minimum" in a.why
    assert decide(CFG, Observation(5, engines(p=0), pending=True), state) is None


def test_an_add_that_ends_during_a_look_counts_as_pending():
    """The look reads the engines, then the add finishes while it reads
    their stats: the engines it read lack the new one, so the look must
    not act on them (it added one past max)."""
    import threading
    from types import SimpleNamespace

    from pdserve.cluster.autoscaler import Autoscaler

    done = threading.Event()
    scaler = Autoscaler.__new__(Autoscaler)            # the look alone: no loop, no Ray
    scaler.policy, scaler._seen, scaler._last_load = CFG, set(), None
    scaler._pending = threading.Thread(target=done.wait)
    scaler._pending.start()

    class Router:
        def server_info(self):
            return {"engines": [{"name": "pdserve:prefill-0", "role": "prefill",
                                 "alive": True}]}

        def stats_response(self):
            done.set()                                 # the add ends mid-look
            scaler._pending.join()
            load = SimpleNamespace(ttft_bounds=[], ttft_counts=[], itl_bounds=[],
                                   itl_counts=[], arrivals=0)
            return SimpleNamespace(engines=[], load=load)
    assert scaler.observe(Router(), 0).pending


def test_an_engine_comes_off_only_after_a_calm_spell_and_when_the_rest_carry_it():
    state = PolicyState()
    calm = dict(ttft_p95=0.2, itl_p95=0.02)
    assert decide(CFG, Observation(0, engines(p=2, d=2, d_used=20), **calm), state) is None
    assert decide(CFG, Observation(20, engines(p=2, d=2, d_used=20), **calm), state) is None
    a = decide(CFG, Observation(31, engines(p=2, d=2, d_used=20), **calm), state)
    # 40 pages in use fit in the one D left (100 pages, low water 50)
    assert (a.kind, a.role) == ("drain", "decode") and a.engine.startswith("decode-")
    # next: cooldown, then the prefill side
    assert decide(CFG, Observation(35, engines(p=2, d=1, d_used=40), **calm), state) is None
    a = decide(CFG, Observation(42, engines(p=2, d=1, d_used=40), **calm), state)
    assert (a.kind, a.role) == ("drain", "prefill")


def test_no_removal_when_the_survivors_could_not_hold_the_load_or_at_min():
    state = PolicyState(calm_since=0)
    busy = engines(p=1, d=2, d_used=40)                 # 80 pages into one D of 100: > 50%
    assert decide(CFG, Observation(100, busy, ttft_p95=0.2), state) is None
    assert decide(CFG, Observation(100, engines(p=1, d=1), ttft_p95=0.2), state) is None


def test_a_breach_resets_the_calm_clock():
    state = PolicyState()
    decide(CFG, Observation(0, engines(p=2, d=2), ttft_p95=0.2), state)
    decide(CFG, Observation(25, engines(p=2, d=2), itl_p95=0.5), state)       # adds nothing: max
    assert state.calm_since is None
    assert decide(CFG, Observation(40, engines(p=2, d=2), ttft_p95=0.2), state) is None


@pytest.mark.parametrize("data,msg", [
    ({"prefill": {"min": 3, "max": 2}}, "min 3 is above max 2"),
    ({"decode": {"min": 0, "max": 2}}, "autoscale.decode.min"),
    ({"ttft_s": 0}, "autoscale.ttft_s"),
    ({"kv_high": 1.5}, "autoscale.kv_high"),
    ({"queue_high": 0}, "autoscale.queue_high must be an integer >= 1"),
    ({"queue_high": -3}, "autoscale.queue_high"),
    ({"ttft": 1}, "unknown key autoscale.ttft"),
])
def test_bad_config_names_the_key_and_the_fix(data, msg):
    with pytest.raises(ConfigError, match=msg):
        AutoscaleConfig.from_dict(data)
