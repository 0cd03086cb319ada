"""D asks P to prefill and P refuses: D prefills the request itself at once,
with nothing fenced (a refusal posted no write), rather than wait out the
landing timeout and then fence pages nothing writes."""

import time

import grpc
import pytest

from pdserve.engine.peer.messages import PeerRpc

from support.engine_fakes import ack, one_round, remote_prefill_asked, sent, server


@pytest.mark.parametrize("code, stage", [(grpc.StatusCode.FAILED_PRECONDITION, "prefill_draining"),
                                         (grpc.StatusCode.INVALID_ARGUMENT, "prefill_refused")])
def test_a_refused_remote_prefill_is_prefilled_on_d_at_once_and_fences_nothing(code, stage):
    """FAILED_PRECONDITION: P drains. INVALID_ARGUMENT: P refused the request,
    e.g. it still holds an earlier copy of the id (a router resubmission to
    a new D while P keeps the old D's twin)."""
    d = server("decode", "decode-0", "prefill-0")
    ask = remote_prefill_asked(d)
    d.peer._prefill_not_taken("x", ask.epoch, "prefill-0", code)
    assert "x" not in d.planner.landing
    assert d.counts.fences == 0 and d.counts.failures_by_stage == {stage: 1}
    d.peer.timers(time.monotonic() + 31)                   # no timeout left to fire
    assert d.counts.failures_by_stage == {stage: 1}
    for _ in range(50):
        if not one_round(d):
            break
    assert "x" not in d.planner.requests
    d.planner.assert_idle()


def test_a_late_ack_for_an_earlier_attempt_leaves_the_live_copy_alone():
    """P prefills x for decode-1 (a resubmission) when decode-0's release
    ack for its own, earlier attempt at x arrives: P keeps decode-1's copy
    (it dropped it and told no one, so decode-1 waited out its timeout). So
    does a late ack from decode-1 for its own earlier attempt (epoch 3: the
    same D, resubmitted the id after P's lease ran out). The ack from
    decode-1 for this attempt releases it."""
    from pdserve.proto import control_pb2 as pb

    p = server("prefill", "prefill-0", "decode-1")
    p.peer.remote_prefill(pb.RemotePrefillRequest(
        request_id="x", token_ids=list(range(1, 18)), landing_pages=list(range(5)), epoch=7,
        target_engine="decode-1", target_incarnation=1,
        prefill_incarnation=1))
    p.peer.transfer_ack(ack("x", 3, "decode-0", release_only=True))
    assert "x" in p.planner.requests and "x" in p.peer.remote
    p.peer.transfer_ack(ack("x", 3, "decode-1", release_only=True))
    assert "x" in p.planner.requests and "x" in p.peer.remote
    p.peer.transfer_ack(ack("x", 7, "decode-1", release_only=True))
    assert "x" not in p.planner.requests and not p.peer.remote
    p.planner.assert_idle()


def test_a_transfer_failed_for_a_landing_d_already_fenced_keeps_it_quarantined():
    """D timed out x's landing and quarantined its pages; P's TransferFailed
    for that attempt comes after. The pages stay held (P's report says the
    write failed, not that D asked and P knows no write of it is left):
    they come back on P's TransferEnded, and then nothing of x is leaked."""
    from pdserve.proto import control_pb2 as pb

    d = server("decode", "decode-0", "prefill-0")
    ask = remote_prefill_asked(d)
    now = time.monotonic()
    d.peer.timers(now + 31)                                # the landing times out
    assert d.counts.fences == 1
    d.peer.transfer_failed_from_peer(pb.TransferFailedRequest(
        request_id="x", epoch=ask.epoch, reason="the write failed", engine="prefill-0",
        incarnation=1))
    for _ in range(50):
        if not one_round(d):
            break
    assert "x" not in d.planner.requests and d.stats().quarantined_pages == 5
    d.peer.transfer_ended_from_peer(pb.TransferEndedRequest(
        request_id="x", epoch=ask.epoch, engine="prefill-0", incarnation=1))
    d.planner.assert_idle()


def test_p_posts_no_write_whose_pages_do_not_match_the_landing_and_tells_d_why():
    """P's pages for x and D's landing pages differ in number (the engines
    group the model's layers differently): P writes nothing, and tells D,
    naming what to make the same; D's release then lets the twin go."""
    from pdserve.proto import control_pb2 as pb

    p = server("prefill", "prefill-0", "decode-1")
    p.peer.remote_prefill(pb.RemotePrefillRequest(
        request_id="x", token_ids=list(range(1, 18)), landing_pages=[0, 1], epoch=7,
        target_engine="decode-1", target_incarnation=1,
        prefill_incarnation=1))
    for _ in range(20):
        if one_round(p) is None:
            break
    (failed,) = [m for _, rpc, m in sent(p) if rpc is PeerRpc.TRANSFER_FAILED]
    assert failed.epoch == 7 and "engine.page_size on both roles" in failed.reason
    assert not p.transport.in_flight("x") and p.counts.transfers == 0
    p.peer.transfer_ack(ack("x", 7, "decode-1", release_only=True))
    assert p.peer.idle()
    p.planner.assert_idle()


def test_a_remote_prefill_whose_prior_output_exceeds_its_tokens_is_refused_by_p_itself():
    """The RPC edge refuses it (control_checks); so does the protocol, for
    a caller that did not come through the edge, before it holds anything."""
    from pdserve.proto import control_pb2 as pb
    from pdserve.scheduler.planner import RejectedRequest

    p = server("prefill", "prefill-0", "decode-1")
    with pytest.raises(RejectedRequest, match="prior_output=18 exceeds"):
        p.peer.remote_prefill(pb.RemotePrefillRequest(
            request_id="x", token_ids=list(range(1, 18)), landing_pages=list(range(5)),
            epoch=7, target_engine="decode-1", target_incarnation=1, prior_output=18,
            prefill_incarnation=1))
    assert p.peer.idle() and not p.planner.requests
