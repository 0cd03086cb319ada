"""A round whose forward raises (a CUDA error, say) on a P or D engine: the
requests it computed fail with the error, and the round's peer work still
happens, so nothing waits forever."""

import time

from pdserve.proto import control_pb2 as pb
from pdserve.engine.outputs import StreamError
from pdserve.engine.peer.messages import PeerRpc
from pdserve.scheduler import Request, SamplingLimits
from pdserve.transfer import Incarnation
from pdserve.transfer.transport import TransferEvent, TransferEventKind

from support.engine_fakes import one_round, sent, server


def test_a_failed_round_on_d_still_asks_for_its_remote_admission():
    """D's round holds r1's decode and r2's remote admission, and its forward
    raises: r1 fails with the error, and r2's RemotePrefill still goes out
    with its landing timed, so r2 is never left reserving pages with no
    peer asked and no timeout to end it."""
    d = server("decode", "decode-0", "prefill-0")

    def submit(rid):
        r = Request(rid, list(range(1, 18)), SamplingLimits(max_new_tokens=50))
        r.peer = "prefill-0"
        d.planner.submit(r)
        d.owner[rid] = "router"
    submit("r1")
    one_round(d)
    (_, _, ask), = sent(d)
    d.peer.on_transfer_event(TransferEvent(TransferEventKind.LANDED, "r1", ask.epoch,
                                           Incarnation("prefill-0", 1), first_token=5))
    sent(d).clear()
    submit("r2")
    d.executor.fail = "CUDA error: an illegal memory access"
    out = one_round(d)
    d.executor.fail = None
    assert [r.id for r in out.failed] == ["r1"]
    assert [op.req.id for op in out.plan.remote_prefills] == ["r2"]
    errors = [(i.req_id, "CUDA error" in i.error) for i in d.outputs.items
              if isinstance(i, StreamError)]
    assert errors == [("r1", True)]
    assert [(to, m, msg.request_id) for to, m, msg in sent(d)] == \
        [("prefill-0", PeerRpc.REMOTE_PREFILL, "r2")]
    # P never answers: the landing times out and D prefills r2 itself
    d.peer.timers(time.monotonic() + 31)
    assert "r2" not in d.planner.landing and "r2" in d.planner.requests
    for _ in range(100):
        if not one_round(d):
            break
    d.planner.check_invariants()
    assert "r2" not in d.planner.requests


def test_a_failed_round_on_p_tells_d_and_lets_its_twin_go():
    """P's forward raises while it prefills a twin: the twin fails, D is told
    at once (it prefills the request itself), and P keeps no lease or
    record of it, so P can go idle and a drain can stop."""
    p = server("prefill", "prefill-0", "decode-0")
    p.peer.remote_prefill(pb.RemotePrefillRequest(
        request_id="x", token_ids=list(range(1, 18)), first_page=0,
        landing_pages=list(range(5)), epoch=1, target_engine="decode-0", target_incarnation=1,
        prefill_incarnation=1))
    p.executor.fail = "CUDA error"
    out = one_round(p)
    assert [r.id for r in out.failed] == ["x"]
    assert [(to, m, msg.request_id) for to, m, msg in sent(p)] == \
        [("decode-0", PeerRpc.TRANSFER_FAILED, "x")]
    assert not p.peer.remote and len(p.peer.leases) == 0
    assert p.nothing_live()
    p.planner.assert_idle()
