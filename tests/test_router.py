"""Router pairing without a cluster: least outstanding tokens, prefix
affinity within a slack, and no engine that is down."""

import pytest

from pdserve.cluster.config import ServeConfig
from pdserve.cluster.pairing import AFFINITY_SLACK_TOKENS
from pdserve.cluster.router import RequestError, Router
from pdserve.kernels.tokenizer import PrintableTokenizer


def router(shape):
    cfg = ServeConfig.from_dict({"engine": {"page_size": 4}, "cluster": shape})
    engines = [(f"{role}-{i}", role, f"127.0.0.1:{9000 + n}")
               for n, (role, i) in enumerate((r, i) for r in ("fused", "prefill", "decode")
                                             for i in range(shape.get(r, 0)))]
    return Router(cfg, PrintableTokenizer(), 98, engines)


def test_the_least_loaded_decode_and_prefill_engines_are_paired():
    r = router({"prefill": 2, "decode": 2, "fused": 0})
    r.engines["decode-0"].load = 100
    r.engines["prefill-1"].load = 100
    d, p = r.pick("", [1, 2, 3, 4, 5])
    assert (d.name, p.name) == ("decode-1", "prefill-0")


def test_a_warm_prefix_wins_within_the_slack_and_loses_beyond_it():
    r = router({"fused": 2, "prefill": 0, "decode": 0})
    first, _ = r.pick("", [1, 2, 3, 4, 9])
    first.load += AFFINITY_SLACK_TOKENS            # busier, but within the slack
    again, _ = r.pick("", [1, 2, 3, 4, 7, 7])     # same first page
    assert again is first
    first.load += 1
    other, _ = r.pick("", [1, 2, 3, 4])
    assert other is not first


def test_a_dead_engine_is_never_picked_and_no_engine_is_a_clear_error():
    r = router({"fused": 1, "prefill": 1, "decode": 1})
    r.engines["fused-0"].alive = False
    d, p = r.pick("")
    assert d.name == "decode-0" and p.name == "prefill-0"
    r.engines["prefill-0"].alive = False
    import pytest

    with pytest.raises(LookupError, match="no live engine can serve route 'disaggregated': "
                                          "fused-0 is down; prefill-0 is down; a decode "
                                          "engine needs a live prefill engine beside it"):
        r.pick("disaggregated")


def test_past_the_in_flight_limit_a_request_is_refused_not_queued_without_bound():
    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "router": {"max_requests": 2}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    sp = __import__("pdserve").SamplingParams(max_tokens=4)
    r.open([1, 2], sp)
    r.open([1, 2], sp)
    import pytest

    with pytest.raises(RequestError, match="2 requests are in flight") as e:
        r.open([1, 2], sp)
    assert e.value.kind == "overloaded"


def test_the_http_front_maps_router_refusals_to_openai_errors():
    from starlette.testclient import TestClient

    from pdserve.cluster.http_api import build_app

    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "router": {"max_requests": 1},
                                 "engine": {"total_pages": 8, "page_size": 4}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    r.open([1], __import__("pdserve").SamplingParams())          # the one slot is taken
    http = TestClient(build_app(r))
    resp = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert resp.status_code == 429 and resp.json()["error"]["type"] == "rate_limit_error"
    resp = http.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert "exceeds this deployment's bound" in resp.json()["error"]["message"]
    resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                  "content": "hi"}]})
    assert resp.status_code == 400 and "no chat template" in resp.json()["error"]["message"]
    assert http.get("/v1/nothing").status_code == 404
    r.engines["fused-0"].alive = False
    assert http.get("/health").status_code == 503


def test_a_draining_engine_is_never_picked_and_the_refusal_says_why():
    import pytest

    r = router({"fused": 2, "prefill": 1, "decode": 1})
    r.engines["fused-0"].draining = True
    r.engines["prefill-0"].draining = True       # a D with no P left is no candidate either
    assert {r.pick("")[0].name for _ in range(4)} == {"fused-1"}
    r.engines["fused-1"].draining = True
    with pytest.raises(LookupError) as e:
        r.pick("")
    assert str(e.value) == (
        "no live engine can serve route any (''): fused-0 is draining; fused-1 is draining; "
        "prefill-0 is draining; a decode engine needs a live prefill engine beside it")


def test_a_request_refused_by_a_draining_engine_is_submitted_to_another():
    import asyncio

    import grpc

    from pdserve.cluster.engine_link import EngineLink
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
            r.links[name] = link = EngineLink(r.engines[name], r.id)
            link.ready.set()
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

    from pdserve.cluster.engine_link import EngineLink
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
        r.links["fused-0"] = link = EngineLink(r.engines["fused-0"], r.id)
        link.ready.set()
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

    from pdserve.cluster.engine_link import EngineLink
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
        r.links["fused-0"] = link = EngineLink(r.engines["fused-0"], r.id)
        link.ready.set()
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


def test_the_prompt_bound_is_the_context_when_every_layer_slides():
    """A full-history model's longest prompt is what its pool holds; with
    every layer sliding a prompt's pages do not grow with it, so only the
    context bounds it (what the engines accept)."""
    cfg = ServeConfig.from_dict({"engine": {"page_size": 4, "total_pages": 64,
                                            "max_context_tokens": 4096},
                                 "cluster": {"fused": 1}})
    engines = [("fused-0", "fused", "127.0.0.1:9")]
    full = Router(cfg, PrintableTokenizer(), 98, engines)
    sliding = Router(cfg, PrintableTokenizer(), 98, engines, full_history=False)
    assert full.max_prompt_tokens < 64 * 4
    assert sliding.max_prompt_tokens == 4096 - cfg.engine.decode_input_tokens


def test_a_mailbox_hands_over_everything_that_came_in_order_and_wakes_its_reader():
    """The reader waiting on an empty mailbox wakes on the first put; puts
    made while it was busy come out together, oldest first; a reader that
    was cancelled while waiting leaves the mailbox usable."""
    import asyncio

    from pdserve.cluster.engine_link import LOST
    from pdserve.mailbox import Mailbox

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

    from pdserve.cluster.engine_link import EngineLink

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
        r.links["fused-0"] = link = EngineLink(r.engines["fused-0"], r.id)
        link.ready.set()
        stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=4))

        async def client():
            async for _ in stream.events():
                pass
        task = asyncio.ensure_future(client())
        await asyncio.wait_for(engine.entered.wait(), 5)
        task.cancel()                           # the client disconnects mid-Submit
        await asyncio.gather(task, return_exceptions=True)
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

    from pdserve.cluster.engine_link import EngineLink

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
        r.links["fused-0"] = link = EngineLink(r.engines["fused-0"], r.id)
        link.ready.set()
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

    from pdserve.cluster.engine_link import EngineLink

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
        r.links["fused-0"] = link = EngineLink(r.engines["fused-0"], r.id)
        link.ready.set()
        stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=4))

        async def client():
            async for _ in stream.events():
                pass
        task = asyncio.ensure_future(client())
        await asyncio.wait_for(engine.entered.wait(), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.release.set()
        await asyncio.gather(*r._background)
    asyncio.run(asyncio.wait_for(go(), 10))
    assert calls == (["abort"] if aborted else [])


def test_a_client_gone_while_its_submit_waits_for_a_slot_costs_the_engine_nothing():
    """Past SUBMITS_IN_FLIGHT a Submit waits its turn in the router; a client
    that leaves meanwhile never reaches the engine."""
    import asyncio

    from pdserve.cluster.engine_link import EngineLink

    r = router({"fused": 1, "prefill": 0, "decode": 0})
    submitted = []

    class Engine:
        async def Submit(self, sub, timeout):
            submitted.append(sub.request_id)

        async def Abort(self, req, timeout):
            raise AssertionError("nothing to abort")

    async def go():
        r.engines["fused-0"].stub = Engine()
        r.links["fused-0"] = link = EngineLink(r.engines["fused-0"], r.id)
        link.ready.set()
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

    from pdserve.cluster.engine_link import SUBMITS_IN_FLIGHT, EngineLink
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
        r.links["fused-0"] = link = EngineLink(r.engines["fused-0"], r.id)
        link.ready.set()

        async def one():
            stream = r.open([1, 2, 3], __import__("pdserve").SamplingParams(max_tokens=1))
            return [d async for d in stream.events()]
        return await asyncio.gather(*(one() for _ in range(n)))
    results = asyncio.run(asyncio.wait_for(go(), 30))
    assert len(results) == n and all(d[-1].finish_reason == "length" for d in results)
    assert state["most"] == SUBMITS_IN_FLIGHT


def test_the_http_front_refuses_what_it_cannot_do_by_name_before_any_engine_is_asked():
    """Each body is refused with a 400 (or a 404 for another model) whose
    param and message say what to change; none reaches an engine (this
    router has no live link), and a request that could never run is not
    counted as an arrival."""
    from starlette.testclient import TestClient

    from pdserve.cluster.http_api import build_app

    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "router": {"max_requests": 8},
                                 "engine": {"total_pages": 64, "page_size": 4,
                                            "max_context_tokens": 64}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    http = TestClient(build_app(r))
    cases = [
        ({"prompt": ["ab", "cd", "ef"], "n": 3}, 400, "n", "9 choices (prompts x n) exceed"),
        ({"prompt": "ab", "route": "disaggregated"}, 400, "route", "needs decode and prefill"),
        ({"prompt": "ab", "model": "gpt-9"}, 404, "model", "is not served here"),
        ({"prompt": ["ab", 1]}, 400, "prompt", "one kind, not mixed"),
        ({"prompt": ["ab", ""]}, 400, "prompt[1]", "the prompt is empty"),
        ({"prompt": "ab", "stop": ["x"] * 17}, 400, "stop", "at most 16 stop strings, got 17"),
        ({"prompt": "ab", "stream_options": {"include_usage": True}}, 400, None,
         "stream_options is only for streamed answers"),
        ({"prompt": "ab", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens",
         "min_tokens=5 exceeds the 2 tokens this request may generate"),
        ({"prompt": "ab", "min_tokens": 17}, 400, "min_tokens",    # completions' default: 16
         "min_tokens=17 exceeds the 16 tokens"),
        ({"prompt": "ab", "min_p": 0.1}, 400, "min_p", "min_p is not supported"),
        ({"prompt": "ab", "guided_choice": ["yes", "no"]}, 400, "guided_choice",
         "structured output is not supported"),
        ({"prompt": "ab", "response_format": {"type": "json_object"}}, 400, "response_format",
         "only response_format {type: text}"),
        ({"prompt": "ab", "include_stop_str_in_output": True}, 400,
         "include_stop_str_in_output", "not supported"),
        ({"prompt": "ab", "temperature": True}, 400, "temperature", "valid number"),
        ({"prompt": "x" * 64, "max_tokens": 1}, 400, "prompt", "exceeds this deployment's bound"),
        ({"prompt": "ab", "max_token": 4}, 400, "max_token", "did you mean 'max_tokens'?"),
    ]
    for body, status, param, words in cases:
        resp = http.post("/v1/completions", json=body)
        err = resp.json()["error"]
        assert resp.status_code == status and err["param"] == param, (body, err)
        assert words in err["message"] and not err["message"].startswith("Value error"), \
            (body, err)
    assert r.metrics.arrivals._value.get() == 0
    assert not r.active
    chat = [({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
              "add_generation_prompt": False}, "the last message to be the assistant's"),
            ({"messages": [{"role": "assistant", "content": "hi"}],
              "continue_final_message": True}, "set add_generation_prompt: false"),
            ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
             "function calling is not supported")]
    for body, words in chat:
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400 and words in resp.json()["error"]["message"], resp.json()


def test_a_prompt_of_the_whole_context_is_refused_naming_the_prompt_not_max_tokens():
    """The decode slot needs a position in the context: the longest prompt
    is the context minus it, and one that long may still ask for a token."""
    cfg = ServeConfig.from_dict({"cluster": {"fused": 1},
                                 "engine": {"total_pages": 64, "page_size": 4,
                                            "max_context_tokens": 64}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    sp = __import__("pdserve").SamplingParams(max_tokens=1)
    r.check_prompt([5] * 63, sp)
    import pytest

    with pytest.raises(RequestError, match="shorten the prompt") as e:
        r.check_prompt([5] * 64, sp)
    assert e.value.param == "prompt"


def test_any_64_bit_seed_is_taken_and_stays_reproducible():
    from pdserve.cluster.openai_protocol import CompletionRequest

    seeds = (-1, -(1 << 63), (1 << 63) - 1, (1 << 63) + 1, (1 << 64) - 2, 0, 7)
    taken = [CompletionRequest(prompt="ab", seed=s).sampling(4, None).seed for s in seeds]
    assert all(0 <= t < 1 << 64 for t in taken) and len(set(taken)) == len(seeds)
    assert taken[-1] == 7 and taken[0] == (1 << 64) - 1          # -1 as 64 bits


def test_two_thousand_calls_at_once_all_get_answered():
    """gRPC's server resets calls no handler has taken yet past 1,000 of them
    (a client saw CANCELLED): the router's server takes as many as
    router.max_requests allows in flight, and more."""
    import asyncio
    import collections

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.cluster.router_grpc import grpc_server

    r = router({"fused": 1, "prefill": 0, "decode": 0})

    async def go():
        server, port = await grpc_server(r, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                res = await asyncio.gather(*(stub.Check(health_pb2.HealthCheckRequest(),
                                                        timeout=60) for _ in range(2048)),
                                           return_exceptions=True)
        finally:
            await server.stop(0)
        return collections.Counter(type(x).__name__ if isinstance(x, Exception) else "ok"
                                   for x in res)
    assert asyncio.run(go()) == {"ok": 2048}


def test_a_small_client_body_limit_does_not_bound_what_engines_send_the_router():
    """router.max_body_bytes bounds clients' messages. A P or D engine's
    GetInfo (its NIXL metadata) is larger than 2,000 bytes: with the limit
    on the router's own channels, every engine looked dead and every request
    got 503. A P, a D and a router in this process, no Ray."""
    from pdserve.client import Client
    from pdserve.kernels.loader import load_tokenizer
    from pdserve.roles.engine_server import EngineServer

    cfg = ServeConfig.from_dict({"cluster": {"prefill": 1, "decode": 1},
                                 "router": {"max_body_bytes": 2000}})
    engines = [EngineServer(cfg, role, 0) for role in ("prefill", "decode")]
    r = Router(cfg, load_tokenizer(None, "tiny"), 98,
               [(e.name, e.role.value, e.address) for e in engines])
    try:
        address = r.start()
        with Client(address, timeout=60) as c:
            assert [e["alive"] for e in c.server_info()["engines"]] == [True, True]
            out = c.generate("Hello", max_tokens=40, ignore_eos=True)
        assert len(out.token_ids) == 40
    finally:
        r.stop()
        for e in engines:
            e.shutdown()


def test_only_near_misses_of_known_fields_are_refused_other_unknown_fields_are_ignored():
    from pdserve.cluster.http_api import _misspelt
    from pdserve.cluster.openai_protocol import ChatCompletionRequest, CompletionRequest

    fields = CompletionRequest.model_fields
    assert _misspelt({"prompt": "a", "temprature": 1}, fields) == ("temprature", "temperature")
    assert _misspelt({"prompt": "a", "stop_tokens_ids": [1]}, fields) == \
        ("stop_tokens_ids", "stop_token_ids")
    sent_by_clients = {"metadata": {}, "store": False, "parallel_tool_calls": True,
                       "service_tier": "auto", "reasoning_effort": "low", "modalities": [],
                       "prediction": None, "audio": None, "max_completion_tokens": 4,
                       "top_logprobs": 2, "priority": 0, "request_id": "x"}
    assert _misspelt(sent_by_clients, fields) is None
    assert _misspelt(sent_by_clients, ChatCompletionRequest.model_fields) is None
