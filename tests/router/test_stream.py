"""One request on the router, its engine a stand-in (no cluster): the Submit
and its slot, a client that leaves at each moment, an engine that refuses
or whose call breaks, and the deltas the client reads."""

import pytest

from pdserve.config import ServeConfig
from pdserve.router.router import RequestError, Router
from pdserve.text.tokenizer import PrintableTokenizer

from support.router_fakes import leave_during_submit, linked, router


def test_a_request_refused_by_a_draining_engine_is_submitted_to_another():
    import asyncio

    import grpc
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 2, "prefill": 0, "decode": 0})
    tried = []

    class Draining:
        async def Submit(self, sub, timeout):
            tried.append("fused-0")
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION,
                                       grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="fused-0 is draining and takes no new request")

    class Serving:
        async def Submit(self, sub, timeout):
            tried.append("fused-1")
            r.links["fused-1"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[7, 8], text="ab", finish_reason="length"))

    async def go():
        for name, stub in (("fused-0", Draining()), ("fused-1", Serving())):
            r.engines[name].stub = stub
            linked(r, name)
        stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=2))
        return [d async for d in stream.events()]
    deltas = asyncio.run(go())
    assert tried == ["fused-0", "fused-1"]       # least loaded first; refused; the other
    assert [t for d in deltas for t in d.token_ids] == [7, 8]
    assert deltas[-1].engine == "fused-1" and deltas[-1].finish_reason == "length"
    assert r.engines["fused-0"].draining and r.engines["fused-0"].alive
    assert r.counters["resubmitted"] == 0        # nothing streamed: not a resubmission


def test_events_that_pile_up_behind_a_slow_reader_go_out_as_one_delta_in_order():
    """Three rounds' events queued before the client reads: one delta with
    all their tokens and text, in order; an event after the client caught
    up is a delta of its own; an error after tokens still ends the stream."""
    import asyncio

    import pytest
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 1, "prefill": 0, "decode": 0})

    def event(rid, tokens, text, finish=""):
        return cpb.RequestEvent(request_id=rid, token_ids=tokens, text=text,
                                finish_reason=finish)

    class Engine:
        async def Submit(self, sub, timeout):
            q = r.links["fused-0"].requests[sub.request_id]
            for i, t in enumerate((5, 6, 7)):
                q.put(event(sub.request_id, [t], "abc"[i]))

        async def Abort(self, req, timeout):
            return None

    async def go():
        r.engines["fused-0"].stub = Engine()
        link = linked(r, "fused-0")
        stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=4))
        deltas = []
        async for d in stream.events():
            deltas.append(d)
            if len(deltas) == 1:                 # caught up: the last token comes alone
                link.requests[stream.id].put(event(stream.id, [8], "d", "length"))
        broken = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=4))
        got = []
        with pytest.raises(RequestError, match="engine error: boom"):
            async for d in broken.events():
                got.append(d)
                link.requests[broken.id].put(
                    cpb.RequestEvent(request_id=broken.id, error="engine error: boom"))
        return deltas, got
    deltas, got = asyncio.run(go())
    assert [(d.token_ids, d.text, d.finish_reason) for d in deltas] == \
        [([5, 6, 7], "abc", ""), ([8], "d", "length")]
    assert [d.token_ids for d in got] == [[5, 6, 7]]


def test_stream_interval_sends_k_tokens_a_message_and_the_rest_last():
    """router.stream_interval: 2 with one token an event, each sent only
    after the client read the previous message: [5, 6], [7, 8], then [9]
    with the finish reason."""
    import asyncio
    from pdserve.proto import control_pb2 as cpb

    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "router": {"stream_interval": 2}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    tokens = [5, 6, 7, 8, 9]

    class Engine:
        rid, next = None, 0

        async def Submit(self, sub, timeout):
            self.rid = sub.request_id
            self.send()

        def send(self):
            t = tokens[self.next]
            self.next += 1
            r.links["fused-0"].requests[self.rid].put(cpb.RequestEvent(
                request_id=self.rid, token_ids=[t], text=chr(ord("a") + t),
                finish_reason="length" if self.next == len(tokens) else ""))

    engine = Engine()

    async def go():
        r.engines["fused-0"].stub = engine
        linked(r, "fused-0")
        stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=5))
        out = []
        agen = stream.events()
        pending = asyncio.ensure_future(agen.__anext__())
        while True:
            await asyncio.sleep(0)
            if pending.done():
                try:
                    out.append(pending.result())
                except StopAsyncIteration:
                    return out
                pending = asyncio.ensure_future(agen.__anext__())
            elif engine.rid and engine.next < len(tokens) and \
                    engine.rid in r.links["fused-0"].requests and \
                    not r.links["fused-0"].requests[engine.rid].pending():
                engine.send()                      # one event at a time, once the last is taken
    deltas = asyncio.run(asyncio.wait_for(go(), 10))
    assert [(list(d.token_ids), d.text, d.finish_reason) for d in deltas] == \
        [([5, 6], "fg", ""), ([7, 8], "hi", ""), ([9], "j", "length")]


def test_a_mailbox_hands_over_everything_that_came_in_order_and_wakes_its_reader():
    """The reader waiting on an empty mailbox wakes on the first put; puts
    made while it was busy come out together, oldest first; a reader that
    was cancelled while waiting leaves the mailbox usable."""
    import asyncio

    from pdserve.router.engines.link import LOST
    from pdserve.router.mailbox import Mailbox

    async def go():
        box = Mailbox(asyncio.get_running_loop())
        reader = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)                       # the reader now waits
        assert not reader.done()
        box.put(1)
        first = list(await reader)
        for x in (2, 3, LOST):
            box.put(x)
        rest = list(await box.take())
        gone = asyncio.ensure_future(box.take())
        await asyncio.sleep(0)
        gone.cancel()
        box.put(4)                                   # no one waits: kept for the next take
        after = list(await box.take())
        return first, rest, after
    first, rest, after = asyncio.run(go())
    assert first == [1]
    assert rest == [2, 3, LOST]
    assert after == [4]


def test_a_client_that_leaves_while_its_submit_is_in_flight_is_aborted_once_taken():
    """The client goes while the engine is still taking the request: the
    Submit is not cut short, and once it returns (the engine has the
    request) the router aborts it there, not before (an Abort sent first
    could overtake the Submit and leave the request running)."""
    import asyncio

    r = router({"fused": 1, "prefill": 0, "decode": 0})
    calls = []

    class Engine:
        def __init__(self):
            self.entered = asyncio.Event()
            self.release = asyncio.Event()

        async def Submit(self, sub, timeout):
            calls.append(("submit", sub.request_id))
            self.entered.set()
            await self.release.wait()
            calls.append(("taken", sub.request_id))

        async def Abort(self, req, timeout):
            calls.append(("abort", req.request_id))

    async def go():
        engine = r.engines["fused-0"].stub = Engine()
        linked(r, "fused-0")
        stream = await leave_during_submit(r)        # the client disconnects mid-Submit
        assert ("abort", stream.id) not in calls
        engine.release.set()                    # the engine takes it now
        for _ in range(100):
            if ("abort", stream.id) in calls:
                break
            await asyncio.sleep(0)
        return stream.id
    rid = asyncio.run(asyncio.wait_for(go(), 10))
    assert calls == [("submit", rid), ("taken", rid), ("abort", rid)]
    assert r.engines["fused-0"].alive and r.engines["fused-0"].load == 0


def test_a_submit_grpc_cancelled_leaves_the_engine_live_aborts_the_request_and_says_retry():
    """gRPC resets calls a server has no room for (CANCELLED): the engine is
    not dead for it. The router aborts the request there (it may have taken
    it) and the client hears UNAVAILABLE, which it may retry."""
    import asyncio

    import grpc
    import pytest

    r = router({"fused": 1, "prefill": 0, "decode": 0})
    calls = []

    class Engine:
        async def Submit(self, sub, timeout):
            calls.append("submit")
            raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details="CANCELLED")

        async def Abort(self, req, timeout):
            calls.append("abort")

    async def go():
        r.engines["fused-0"].stub = Engine()
        linked(r, "fused-0")
        stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=1))
        with pytest.raises(RequestError, match="was cancelled by gRPC; retry") as e:
            async for _ in stream.events():
                pass
        await asyncio.gather(*r._background)
        return e.value
    err = asyncio.run(asyncio.wait_for(go(), 10))
    assert err.kind == "unavailable" and calls == ["submit", "abort"]
    assert r.engines["fused-0"].alive and r.engines["fused-0"].load == 0
    assert r.counters["resubmitted"] == 0


@pytest.mark.parametrize("code,aborted", [("CANCELLED", True), ("DEADLINE_EXCEEDED", True),
                                          ("INVALID_ARGUMENT", False)])
def test_a_client_gone_mid_submit_is_aborted_unless_the_engine_refused_it(code, aborted):
    """The Submit the client left behind fails: only a refusal certainly left
    nothing on the engine; a call that broke may have delivered it."""
    import asyncio

    import grpc

    r = router({"fused": 1, "prefill": 0, "decode": 0})
    calls = []

    class Engine:
        def __init__(self):
            self.entered, self.release = asyncio.Event(), asyncio.Event()

        async def Submit(self, sub, timeout):
            self.entered.set()
            await self.release.wait()
            raise grpc.aio.AioRpcError(getattr(grpc.StatusCode, code), grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details=code)

        async def Abort(self, req, timeout):
            calls.append("abort")

    async def go():
        engine = r.engines["fused-0"].stub = Engine()
        linked(r, "fused-0")
        await leave_during_submit(r)
        engine.release.set()
        await asyncio.gather(*r._background)
    asyncio.run(asyncio.wait_for(go(), 10))
    assert calls == (["abort"] if aborted else [])


def test_a_client_gone_while_its_submit_waits_for_a_slot_costs_the_engine_nothing():
    """Past SUBMITS_IN_FLIGHT a Submit waits its turn in the router; a client
    that leaves meanwhile never reaches the engine."""
    import asyncio

    r = router({"fused": 1, "prefill": 0, "decode": 0})
    submitted = []

    class Engine:
        async def Submit(self, sub, timeout):
            submitted.append(sub.request_id)

        async def Abort(self, req, timeout):
            raise AssertionError("nothing to abort")

    async def go():
        r.engines["fused-0"].stub = Engine()
        link = linked(r, "fused-0")
        link.submits = asyncio.Semaphore(0)          # every slot taken
        stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=4))

        async def client():
            async for _ in stream.events():
                pass
        task = asyncio.ensure_future(client())
        for _ in range(20):
            await asyncio.sleep(0)                   # it queues for a slot
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        link.submits.release()                       # a slot frees: nobody takes it for it
        for _ in range(20):
            await asyncio.sleep(0)
        return stream.id, link.submits.locked()
    rid, locked = asyncio.run(asyncio.wait_for(go(), 10))
    assert submitted == [] and not locked and rid not in r.active


def test_the_router_holds_its_submits_to_one_engine_to_a_bound():
    """A burst of requests is submitted SUBMITS_IN_FLIGHT at a time (more on
    one connection and gRPC cancels some); every one still gets in."""
    import asyncio

    from pdserve.router.engines.link import SUBMITS_IN_FLIGHT
    from pdserve.proto import control_pb2 as cpb

    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "engine": {"page_size": 4}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    n = SUBMITS_IN_FLIGHT * 2 + 5
    state = {"now": 0, "most": 0}

    class Engine:
        async def Submit(self, sub, timeout):
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            await asyncio.sleep(0.001)
            state["now"] -= 1
            r.links["fused-0"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[7], text="a", finish_reason="length"))

    async def go():
        r.engines["fused-0"].stub = Engine()
        linked(r, "fused-0")

        async def one():
            stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=1))
            return [d async for d in stream.events()]
        return await asyncio.gather(*(one() for _ in range(n)))
    results = asyncio.run(asyncio.wait_for(go(), 30))
    assert len(results) == n and all(d[-1].finish_reason == "length" for d in results)
    assert state["most"] == SUBMITS_IN_FLIGHT


def test_a_resubmission_carries_the_sampling_and_says_how_much_is_output_already():
    """The engine fails after streaming two tokens: the router resubmits the
    prompt plus those two, says they are output (prior_output, so penalties
    count them) and how much of their text the client has (the new engine
    sends the rest), and keeps every sampling field, with max_tokens and
    min_tokens reduced by what was streamed."""
    import asyncio

    from pdserve import SamplingParams
    from pdserve.router.engines.link import LOST
    from pdserve.proto import control_pb2 as cpb
    from pdserve.proto.sampling import from_options

    r = router({"fused": 2, "prefill": 0, "decode": 0})
    subs = []

    class Failing:
        async def Submit(self, sub, timeout):
            subs.append(sub)
            q = r.links["fused-0"].requests[sub.request_id]
            q.put(cpb.RequestEvent(request_id=sub.request_id, token_ids=[7, 8], text="ab"))
            q.put(LOST)

    class Serving:
        async def Submit(self, sub, timeout):
            subs.append(sub)
            r.links["fused-1"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[9], text="c", finish_reason="length"))

    sp = SamplingParams(max_tokens=3, min_tokens=3, temperature=0.5, seed=4,
                        frequency_penalty=0.5, presence_penalty=-0.25, repetition_penalty=1.5,
                        min_p=0.125, logit_bias={3: 2.5})

    async def go():
        for name, stub in (("fused-0", Failing()), ("fused-1", Serving())):
            r.engines[name].stub = stub
            linked(r, name)
        return [t for d in [d async for d in r.open([1, 2], sp).events()] for t in d.token_ids]
    assert asyncio.run(go()) == [7, 8, 9]
    first, again = subs
    assert list(first.token_ids) == [1, 2] and first.prior_output == 0
    assert list(again.token_ids) == [1, 2, 7, 8] and again.prior_output == 2
    assert (first.prior_text_chars, again.prior_text_chars) == (0, 2)   # 'ab' is out
    assert from_options(first.sampling) == sp
    assert from_options(again.sampling) == SamplingParams(**{**sp.__dict__, "max_tokens": 1,
                                                             "min_tokens": 1})


def test_a_resubmission_under_stream_interval_carries_what_the_client_got_and_no_more():
    """With router.stream_interval 3, an engine streams three tokens (sent
    as one delta), then one more (held: fewer than 3), then dies. The new
    engine's prompt ends with the three the client has; the held one is
    made again there, not dropped (it went into the prompt and never to
    the client, and the answer lost it)."""
    import asyncio

    from pdserve import SamplingParams
    from pdserve.router.engines.link import LOST
    from pdserve.proto import control_pb2 as cpb

    cfg = ServeConfig.from_dict({"cluster": {"fused": 2}, "router": {"stream_interval": 3}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9"),
                                              ("fused-1", "fused", "127.0.0.1:10")])
    subs = []

    class Failing:
        async def Submit(self, sub, timeout):
            subs.append(sub)
            r.links["fused-0"].requests[sub.request_id].put(
                cpb.RequestEvent(request_id=sub.request_id, token_ids=[7, 8, 9], text="abc"))

    class Serving:
        async def Submit(self, sub, timeout):
            subs.append(sub)
            r.links["fused-1"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[10, 11], text="de",
                finish_reason="length"))

    async def go():
        for name, stub in (("fused-0", Failing()), ("fused-1", Serving())):
            r.engines[name].stub = stub
            linked(r, name)
        got = []
        async for d in r.open([1, 2], SamplingParams(max_tokens=5)).events():
            got += d.token_ids
            if got == [7, 8, 9]:                  # the client has these: one more, then death
                q = r.links["fused-0"].requests[subs[0].request_id]
                q.put(cpb.RequestEvent(request_id=subs[0].request_id, token_ids=[10], text="d"))
                q.put(LOST)
        return got
    assert asyncio.run(go()) == [7, 8, 9, 10, 11]
    first, again = subs
    assert list(again.token_ids) == [1, 2, 7, 8, 9] and again.prior_output == 3
    assert again.sampling.max_tokens == 2


def test_a_request_waiting_for_a_slot_while_its_engine_resubscribes_joins_the_new_stream():
    """All of an engine's Submit slots are taken; while a request waits for
    one, the engine's event stream breaks (its requests hear LOST) and
    reconnects under a new subscription. The request is then submitted
    under the new one and reads its events there: it does not take the
    old stream's LOST for its own, mark a live engine dead and leave an
    orphan running on it."""
    import asyncio

    from pdserve import SamplingParams
    from pdserve.router.engines.link import LOST
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 1, "prefill": 0, "decode": 0})
    calls = []

    class Slots:                                  # all taken: the request waits for one
        def __init__(self):
            self.entered, self.free = asyncio.Event(), asyncio.Event()

        async def acquire(self):
            self.entered.set()
            await self.free.wait()

        def release(self):
            pass

    class Engine:
        async def Submit(self, sub, timeout):
            calls.append(("submit", sub.subscriber))
            r.links["fused-0"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[9], text="c", finish_reason="length"))

        async def Abort(self, req, timeout):
            calls.append(("abort", req.request_id))

    async def go():
        r.engines["fused-0"].stub = Engine()
        link = linked(r, "fused-0")
        link.subscriber = "router/1"
        slots = link.submits = Slots()
        stream = r.open([1, 2], SamplingParams(max_tokens=1))
        task = asyncio.ensure_future(
            asyncio.wait_for(_tokens(stream), 10))
        await slots.entered.wait()
        # what the link does when its stream breaks, then when it is back
        link.ready.clear()
        for box in link.requests.values():
            box.put(LOST)
        link.requests.clear()
        link.subscriber = "router/2"
        link.ready.set()
        slots.free.set()
        return await task
    assert asyncio.run(go()) == [9]
    assert calls == [("submit", "router/2")]
    assert r.engines["fused-0"].alive and r.counters["resubmitted"] == 0


async def _tokens(stream) -> list:
    return [t for d in [d async for d in stream.events()] for t in d.token_ids]


def test_an_answer_of_several_choices_ends_with_an_error_any_of_its_streams_raises():
    """n > 1 over HTTP reads every choice's stream at once: a stream that
    fails with anything, not only a refusal, ends the answer with that
    error, as one stream's would, and the other stream is closed (a bug in
    one stream left the whole answer waiting until its client gave up)."""
    import asyncio

    from pdserve.router.merge import merged as _merged

    closed = []

    class Broken:
        async def events(self):
            raise RuntimeError("a bug")
            yield                                  # an async generator

    class Endless:
        async def events(self):
            try:
                await asyncio.Event().wait()
                yield
            finally:
                closed.append("endless")

    async def go():
        async for _ in _merged([Endless(), Broken()]):
            pass
    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(asyncio.wait_for(go(), 10))
    assert closed == ["endless"]


def test_a_submit_the_engine_aborts_for_a_stale_view_is_tried_again_not_refused():
    """An engine refuses a Submit made on an out-of-date view of it (a
    subscription that just ended, a prefill peer it has not met yet) with
    ABORTED: the router tries again, the engine stays live and picked, and
    the client never hears of it (it got a 400 as if its request were
    wrong)."""
    import asyncio

    import grpc
    from pdserve import SamplingParams
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 1, "prefill": 0, "decode": 0})
    tries = []

    class Engine:
        async def Submit(self, sub, timeout):
            tries.append(sub.subscriber)
            if len(tries) == 1:
                raise grpc.aio.AioRpcError(grpc.StatusCode.ABORTED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(),
                                           details="fused-0 has no subscription 'router/1'")
            r.links["fused-0"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[7], text="a", finish_reason="length"))

    async def go():
        r.engines["fused-0"].stub = Engine()
        linked(r, "fused-0")
        return [t async for d in r.open([1, 2], SamplingParams(max_tokens=1)).events()
                for t in d.token_ids]
    assert asyncio.run(go()) == [7]
    assert len(tries) == 2 and r.counters["resubmitted"] == 0
    ref = r.engines["fused-0"]
    assert ref.alive and not ref.draining


def test_an_engine_refuses_a_submit_for_a_subscription_it_does_not_have_as_stale():
    """The engine's side: a Submit naming no live subscription, or a prefill
    peer it was never introduced to, is a StaleView (ABORTED: try again),
    not a bad request."""
    import pytest

    from pdserve.proto import control_pb2 as cpb
    from pdserve.proto import router_pb2 as rpb
    from pdserve.engine.rpc import StaleView

    from support.engine_fakes import server

    s = server("decode", "decode-0", "prefill-0")
    s.outputs.has = lambda sub: sub == "router/2"
    sampling = rpb.SamplingOptions(max_tokens=2)
    with pytest.raises(StaleView, match="no subscription 'router/1'"):
        s.submit(cpb.SubmitRequest(request_id="x", token_ids=[1, 2], subscriber="router/1",
                                   sampling=sampling))
    with pytest.raises(StaleView, match="does not know prefill engine 'prefill-9'"):
        s.submit(cpb.SubmitRequest(request_id="x", token_ids=[1, 2], subscriber="router/2",
                                   sampling=sampling, prefill_peer="prefill-9"))
    assert not s.planner.requests


# ---- liveness: an engine that is unhealthy or silent (router/engines/link.py) -------

def _deadline_exceeded():
    import grpc

    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), details="Deadline Exceeded")


async def _until(cond, what: str, bound: float = 5.0) -> None:
    import asyncio

    deadline = asyncio.get_running_loop().time() + bound
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.001)


def test_a_request_an_unhealthy_engine_sends_nothing_moves_and_its_copy_is_aborted_there():
    """fused-0 streams two tokens, then its loop sticks: it answers
    unhealthy. Nothing moves before the request has heard nothing for
    router.engine_silent_s; then it is resubmitted to fused-1 with the two
    tokens (counted stalled), and fused-0 is picked no more while it holds
    the copy. An Abort of the copy sent while the engine is stuck times
    out; the engine's next healthy answer sends it again, and once it is
    answered fused-0 serves again."""
    import asyncio

    from pdserve import SamplingParams
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 2, "prefill": 0, "decode": 0})
    aborts, stuck = [], [True]

    class Stuck:
        async def Submit(self, sub, timeout):
            r.links["fused-0"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[7, 8], text="ab"))

        async def Abort(self, req, timeout):
            aborts.append(req.request_id)
            if stuck[0]:
                raise _deadline_exceeded()
            return cpb.Ack(ok=True)

    class Serving:
        async def Submit(self, sub, timeout):
            assert list(sub.token_ids) == [1, 2, 7, 8] and sub.prior_output == 2
            r.links["fused-1"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[9], text="c", finish_reason="length"))

    async def go():
        loop = asyncio.get_running_loop()
        for name, stub in (("fused-0", Stuck()), ("fused-1", Serving())):
            r.engines[name].stub = stub
            r.engines[name].healthy_at = loop.time()
            linked(r, name)
        ref, link = r.engines["fused-0"], r.links["fused-0"]
        got: list = []

        async def client():
            async for d in r.open([1, 2], SamplingParams(max_tokens=3)).events():
                got.extend(d.token_ids)
        task = asyncio.ensure_future(client())
        await _until(lambda: got == [7, 8], "the first tokens")
        now = loop.time()
        link.answered(cpb.InfoResponse(unhealthy="loop thread stuck for 6.0 s"), now)
        assert not ref.serving
        assert link.check(now + 4.9) == 0             # heard from 4.9 s ago: not yet
        assert link.check(now + 5.0) == 1
        await asyncio.wait_for(task, 5)
        assert got == [7, 8, 9] and len(ref.orphans) == 1   # the copy fused-0 may hold
        rid = next(iter(ref.orphans))
        link.check(now + 6)                            # an Abort while stuck: times out
        await _until(lambda: aborts == [rid] and link._aborting.done(), "the first abort")
        assert ref.orphans == {rid} and not ref.serving
        stuck[0] = False
        link.answered(cpb.InfoResponse(), now + 7)     # healthy again: at once, again
        await _until(lambda: not ref.orphans, "the orphan aborted")
        assert aborts == [rid, rid] and ref.serving
    asyncio.run(go())
    assert r.counters == {"resubmitted": 1, "stalled": 1}


def test_a_quiet_request_stays_on_a_healthy_engine_and_leaves_a_silent_one():
    """A request that hears nothing (queued behind others, a long prefill)
    stays while its engine answers healthy, however long; once the engine
    has not answered healthy for engine_silent_s it is silent: not picked,
    and the request moves."""
    import asyncio

    from pdserve import SamplingParams
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 2, "prefill": 0, "decode": 0})

    class Quiet:
        async def Submit(self, sub, timeout):
            pass

        async def Abort(self, req, timeout):
            return cpb.Ack(ok=True)

    class Serving:
        async def Submit(self, sub, timeout):
            r.links["fused-1"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[9], text="c", finish_reason="length"))

    async def go():
        loop = asyncio.get_running_loop()
        for name, stub in (("fused-0", Quiet()), ("fused-1", Serving())):
            r.engines[name].stub = stub
            linked(r, name)
        ref, link = r.engines["fused-0"], r.links["fused-0"]
        # a whole number: the sums below stay exact
        now = ref.healthy_at = r.engines["fused-1"].healthy_at = float(int(loop.time()))
        task = asyncio.ensure_future(_tokens(r.open([1, 2], SamplingParams(max_tokens=1))))
        await _until(lambda: link.requests, "submitted")
        for t in (10, 100, 1000):                     # answering healthy all along
            link.answered(cpb.InfoResponse(), now + t - 1)
            assert link.check(now + t) == 0 and ref.serving
        assert link.check(now + 1003.9) == 0 and ref.serving
        assert link.check(now + 1004) == 1
        assert ref.unhealthy == "silent: no healthy answer for 5.0 s" and not ref.serving
        return await asyncio.wait_for(task, 5)
    assert asyncio.run(go()) == [9]
    assert r.counters == {"resubmitted": 1, "stalled": 1}


def test_a_request_whose_submit_sits_on_a_stalled_engine_moves_and_is_orphaned_once_taken():
    """The Submit hangs (the loop that would take it is stuck): the request
    moves once the engine is unhealthy and the request heard nothing for
    engine_silent_s, without waiting out the Submit's 30 s. Its copy is
    left to abort only once that Submit ends taken: an Abort sent before
    could overtake it."""
    import asyncio

    from pdserve import SamplingParams
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 2, "prefill": 0, "decode": 0})
    taken = None

    class Stuck:
        async def Submit(self, sub, timeout):
            await taken.wait()

    class Serving:
        async def Submit(self, sub, timeout):
            r.links["fused-1"].requests[sub.request_id].put(cpb.RequestEvent(
                request_id=sub.request_id, token_ids=[9], text="c", finish_reason="length"))

    async def go():
        nonlocal taken
        taken = asyncio.Event()
        loop = asyncio.get_running_loop()
        for name, stub in (("fused-0", Stuck()), ("fused-1", Serving())):
            r.engines[name].stub = stub
            r.engines[name].healthy_at = loop.time()
            linked(r, name)
        ref, link = r.engines["fused-0"], r.links["fused-0"]
        task = asyncio.ensure_future(_tokens(r.open([1, 2], SamplingParams(max_tokens=1))))
        await _until(lambda: link.requests, "submitted")
        now = loop.time()
        link.answered(cpb.InfoResponse(unhealthy="loop thread stuck for 9.0 s"), now)
        assert link.check(now + 5) == 1
        assert await asyncio.wait_for(task, 5) == [9]
        assert not ref.orphans                         # its Submit has not ended
        taken.set()
        await _until(lambda: ref.orphans, "orphaned once taken")
    asyncio.run(go())
    assert r.counters == {"resubmitted": 1, "stalled": 1}


def test_an_unhealthy_engine_is_named_in_a_refusal_and_listed_in_stats_by_its_health():
    """No engine healthy: a request is refused naming why; `stats` lists
    an engine whose Stats did not answer (its loop is stuck) with its
    health, rather than leaving it out."""
    import asyncio

    import pytest

    from pdserve import SamplingParams
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 1, "prefill": 0, "decode": 0})

    class Stuck:
        async def Stats(self, req, timeout):
            raise _deadline_exceeded()

    ref = r.engines["fused-0"]
    ref.stub, ref.unhealthy, ref.loop_quiet_s = Stuck(), "loop thread stuck for 7.0 s", 7.0
    with pytest.raises(RequestError, match=r"fused-0 is unhealthy \(loop thread stuck"):
        r.open([1, 2], SamplingParams(max_tokens=1))
    (e,) = asyncio.run(r.stats()).engines
    assert (e.name, e.role, e.unhealthy, e.loop_quiet_s, e.total_pages) == \
        ("pdserve:fused-0", "fused", "loop thread stuck for 7.0 s", 7.0, 0)


def test_a_router_that_was_frozen_takes_none_of_its_engines_for_silent():
    """The router's own loop stops for longer than engine_silent_s (the
    router SIGSTOPped, its loop held up): when it runs again the engine has
    not answered for that long, but the time was the router's, not the
    engine's. The engine stays healthy and its quiet request stays put
    (counted as silence, a thawed router refused every new request and
    moved every quiet one)."""
    import asyncio
    import time

    from pdserve import SamplingParams
    from pdserve.router.engines.link import EngineLink
    from pdserve.proto import control_pb2 as cpb

    r = router({"fused": 1, "prefill": 0, "decode": 0})

    class Quiet:
        async def GetInfo(self, req, timeout):
            return cpb.InfoResponse()

        def Subscribe(self, req):
            async def events():
                yield cpb.EngineEvents()
                await asyncio.Event().wait()
            return events()

        async def Submit(self, sub, timeout):
            pass                                # taken; nothing to say yet

    async def go():
        ref = r.engines["fused-0"]
        ref.stub = Quiet()
        link = r.links["fused-0"] = EngineLink(ref, r.id, silent_s=2.5)
        link.start()
        await asyncio.wait_for(link.ready.wait(), 5)
        task = asyncio.ensure_future(_tokens(r.open([1, 2], SamplingParams(max_tokens=1))))
        await _until(lambda: link.requests, "submitted")
        await asyncio.sleep(1.5)                # a probe answered, a check made
        time.sleep(4)                           # the router frozen: no callback runs
        await asyncio.sleep(1.5)                # thawed: the next checks run
        assert ref.unhealthy == "" and ref.serving and len(link.requests) == 1
        task.cancel()
        link.stop()
        await asyncio.gather(task, return_exceptions=True)
    asyncio.run(go())
    assert r.counters == {"resubmitted": 0, "stalled": 0}


def test_a_short_engine_silent_s_shortens_the_probe_period_to_a_quarter():
    """The link probes and checks at most a second apart, and four times
    per engine_silent_s: with 1 s a stuck engine's request moved up to
    3 s late (a probe period to see the verdict, one to stall the request,
    one to abort its copy)."""
    from pdserve.router.engines.link import PROBE_S, EngineLink, probe_period

    assert probe_period(5.0) == PROBE_S == 1.0
    assert probe_period(4.0) == 1.0
    assert probe_period(1.0) == 0.25
    r = router({"fused": 1, "prefill": 0, "decode": 0})
    assert EngineLink(r.engines["fused-0"], r.id, silent_s=0.5).probe_s == 0.125
