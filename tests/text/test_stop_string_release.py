"""A stop string is found on the output thread, after the loop thread has
moved on: the request is let go only if it is still the one the stop string
was found for. An id may be live again by then (a client that cancelled and
retried with its request_id, a resubmission to the same engine)."""

from pdserve.text.sampling_params import SamplingParams
from pdserve.text.tokenizer import PrintableTokenizer
from pdserve.proto import control_pb2 as pb
from pdserve.proto import router_pb2 as rpb
from pdserve.engine.outputs import OutputItem, Outputs

from support.engine_fakes import one_round, run_jobs, server


def test_the_output_thread_names_the_submission_it_found_a_stop_string_for():
    stops = []
    out = Outputs(PrintableTokenizer(), lambda rid, key: stops.append((rid, key)))
    q = out.subscribe("router")
    try:
        key = object()
        out.open("r", "router", [1, 2], SamplingParams(stop=("b",)), key=key)
        out.post([OutputItem("r", [65, 66])])                   # 'a', 'b'
        (event,) = q.get(timeout=10)                             # sent after on_stop
    finally:
        out.close()
    assert event.finish_reason == "stop" and event.text == "a"
    assert stops == [("r", key)]


def test_a_late_stop_string_lets_go_of_its_own_request_not_a_new_one_with_its_id():
    """Old X ends by length on the loop thread while its stop string is still
    on its way through the output thread; X is submitted again. The old
    stop string leaves the new X running (it was aborted with no event to
    its router, which then waited forever); a stop string of the new X
    lets it go."""
    s = server("fused", "fused-0", "none")

    def submit(max_tokens):
        s.submit(pb.SubmitRequest(request_id="X", token_ids=[5, 6, 7], subscriber="router",
                                  sampling=rpb.SamplingOptions(max_tokens=max_tokens,
                                                               stop=["zz"])))
        return s.planner.requests["X"]
    old = submit(2)
    while "X" in s.planner.requests:
        one_round(s)
    assert s.counts.finished == 1
    new = submit(100)
    assert [k for rid, k in s.outputs.opened] == [old, new]
    s._stop_string_hit("X", old)
    run_jobs(s)
    assert s.planner.requests.get("X") is new and "X" in s.owner
    assert s.counts.finished == 1
    s._stop_string_hit("X", new)
    run_jobs(s)
    assert "X" not in s.planner.requests and s.counts.finished == 2
    s.planner.assert_idle()
