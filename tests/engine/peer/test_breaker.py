"""D's circuit breaker per P (engine/peer/breaker.py): after transfers from
a P keep failing (a slow or lossy link, a P that answers pings but not
writes), D prefills the requests paired with it at once instead of each
waiting out the landing timeout, and lets one probe through per cooldown."""

import time

from pdserve.engine.peer.breaker import THRESHOLD, PrefillBreaker

from support.engine_fakes import TRANSFER_S, asked, finish, one_round, pair, submit_for_prefill


def test_it_opens_after_failures_in_a_row_and_a_probe_that_lands_closes_it():
    b = PrefillBreaker(cooldown_s=5.0, probe_s=10.0)
    for _ in range(THRESHOLD - 1):
        b.failed("p", 0.0)
    assert b.allows("p", 0.0)
    b.failed("p", 0.0)
    assert not b.allows("p", 1.0) and b.allows("q", 1.0)     # only that P
    b.failed("p", 2.0)                     # an ask from before it opened: nothing new
    assert not b.allows("p", 4.9)
    assert b.allows("p", 5.0)              # the probe
    assert not b.allows("p", 5.1)          # one at a time
    b.close("p")                           # it landed
    assert b.allows("p", 5.2) and b.allows("p", 5.3)


def test_a_probe_that_fails_opens_it_again_and_a_lost_probe_is_replaced():
    b = PrefillBreaker(cooldown_s=5.0, probe_s=10.0)
    for _ in range(THRESHOLD):
        b.failed("p", 0.0)
    assert b.allows("p", 5.0)
    b.failed("p", 6.0)
    assert not b.allows("p", 10.9) and b.allows("p", 11.0)
    assert not b.allows("p", 20.9)         # that probe never answered (aborted) ...
    assert b.allows("p", 21.0)             # ... so another goes after probe_s


def test_d_prefills_at_once_what_it_would_ask_of_a_p_whose_transfers_keep_timing_out():
    """THRESHOLD landings from prefill-0 time out (its writes never arrive):
    the next request is not asked of it, but prefilled on D at once; past the
    cooldown one request is asked again. Nothing is left held."""
    _, d = pair()
    now = time.monotonic()
    for i in range(THRESHOLD):
        asked(d, f"t{i}")
    d.peer.timers(now + TRANSFER_S + 1)
    assert d.counts.failures_by_stage.get("timeout") == THRESHOLD
    d.peer.clock = lambda: now + TRANSFER_S + 2
    assert "c" not in _asks(d, "c") and d.counts.failures_by_stage.get("prefill_breaker_open") == 1
    d.peer.clock = lambda: now + 2 * TRANSFER_S + 2
    assert "p" in _asks(d, "p")            # the probe
    finish(d)


def _asks(d, rid: str) -> set:
    """Submit `rid` to D for prefill-0 and run rounds; the ids D asked P for."""
    submit_for_prefill(d, rid)
    for _ in range(5):
        one_round(d)
    return set(d.peer.epochs)
