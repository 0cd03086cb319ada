"""The P/D timeouts in the config (`transfer:`), and the relations between
them that a config must keep, refused when it loads with what to change
(transfer/timeouts.py derives each)."""

import dataclasses

import pytest

from pdserve.config import ServeConfig
from pdserve.engine.peer.protocol import PeerTimeouts
from pdserve.scheduler.config import ConfigError


def load(transfer) -> ServeConfig:
    return ServeConfig.from_dict({"transfer": transfer})


def test_the_transfer_section_sets_the_engines_timeouts_and_defaults_to_the_old_ones():
    assert load(None).transfer == PeerTimeouts(transfer_s=30.0, lease_s=10.0, heartbeat_s=2.0)
    t = load({"timeout_s": 5, "lease_s": 4, "heartbeat_s": 1}).transfer
    assert (t.transfer_s, t.lease_s, t.heartbeat_s) == (5, 4, 1)


def test_an_unknown_transfer_key_is_named_with_the_one_meant():
    with pytest.raises(ConfigError, match=r"transfer\.lease\b.*did you mean transfer\.lease_s"):
        load({"lease": 10})


@pytest.mark.parametrize("key", ["timeout_s", "lease_s", "heartbeat_s"])
@pytest.mark.parametrize("value", [0, -1, "10", True])
def test_a_timeout_that_is_not_a_positive_number_is_refused(key, value):
    with pytest.raises(ConfigError, match=rf"transfer\.{key} must be a number of seconds > 0"):
        load({key: value})


def test_a_heartbeat_more_than_half_the_lease_is_refused_with_the_fix():
    """A live D renews P's leases every heartbeat_s; with less than two
    heartbeats a lease, one late heartbeat lets a lease run out while D
    still waits, and P drops a prefill D is owed."""
    with pytest.raises(ConfigError) as e:
        load({"lease_s": 3, "heartbeat_s": 2})
    msg = str(e.value)
    assert "transfer.heartbeat_s=2 is more than half of transfer.lease_s=3" in msg
    assert "make transfer.heartbeat_s at most transfer.lease_s/2" in msg
    load({"lease_s": 4, "heartbeat_s": 2})                  # exactly two a lease: kept


def test_no_timeout_frees_a_landing_d_gave_up_on():
    """D's quarantine is not derived from the timeouts: whatever they are,
    a landing D gave up on keeps its pages past any of them (a frozen P or
    a stalled link outlasts every clock) until P's word or P's end."""
    from support.engine_fakes import remote_prefill_asked, server

    for t in (PeerTimeouts(), PeerTimeouts(transfer_s=3, lease_s=3, heartbeat_s=0.5),
              PeerTimeouts(transfer_s=5, lease_s=60, heartbeat_s=1)):
        d = server("decode", "decode-0", "prefill-0")
        d.peer.landing.timeout_s = t.transfer_s
        remote_prefill_asked(d)
        d.peer.timers(1e6)
        d.peer.timers(1e6 + 10 * (t.lease_s + t.heartbeat_s + t.transfer_s))
        assert len(d.peer.quarantined()) == 1 and d.stats().quarantined_pages == 5


def test_engine_options_over_the_config_are_checked_too():
    """`engine_options` (tests, benchmarks) keep working over `transfer:`,
    and cannot make a pair the config would refuse."""
    from pdserve.cluster.actors import timeouts_for

    cfg = load({"lease_s": 20, "heartbeat_s": 5})
    t = timeouts_for(cfg, transfer_timeout_s=3.0)
    assert t == dataclasses.replace(cfg.transfer, transfer_s=3.0)
    with pytest.raises(ValueError, match="heartbeat_s=5 is more than half of lease_s=6"):
        timeouts_for(cfg, lease_s=6.0)
