"""Router pairing without a cluster: least outstanding tokens, prefix
affinity within a slack, and no engine that is down."""

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

    with pytest.raises(LookupError, match="no live engine can serve route 'disaggregated'"):
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
    with pytest.raises(LookupError, match=r"\(fused-0, fused-1, prefill-0 draining\)"):
        r.pick("")


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
            elif engine.rid and engine.next < len(tokens):
                engine.send()                      # one event at a time
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
