"""The router without a cluster: pairing by least outstanding tokens and
prefix affinity, no engine that is down or draining, the in-flight limit,
the prompt bound, its gRPC server and its channels to the engines."""

import asyncio

import pytest

from pdserve.config import ServeConfig
from pdserve.router.engines.pairing import AFFINITY_SLACK_TOKENS
from pdserve.router.router import RequestError, Router, Security
from pdserve.text.tokenizer import PrintableTokenizer

from support.router_fakes import router


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
    r.engines["prefill-0"].alive = False         # D prefills itself: slower, not refused
    assert r.pick("disaggregated") == (r.engines["decode-0"], None)
    r.engines["decode-0"].unhealthy = "silent for 9.0 s"
    with pytest.raises(LookupError, match="no live engine can serve route 'disaggregated': "
                                          "decode-0 is unhealthy \\(silent for 9.0 s\\); "
                                          "fused-0 is down; prefill-0 is down$"):
        r.pick("disaggregated")


def test_past_the_in_flight_limit_a_request_is_refused_not_queued_without_bound():
    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}, "router": {"max_requests": 2}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    sp = __import__("pdserve").SamplingParams(max_tokens=4)
    r.open([1, 2], sp)
    r.open([1, 2], sp)
    with pytest.raises(RequestError, match="2 requests are in flight") as e:
        r.open([1, 2], sp)
    assert e.value.kind == "overloaded"


def test_the_http_front_maps_router_refusals_to_openai_errors():
    from starlette.testclient import TestClient

    from pdserve.router.http_api import build_app

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
    r = router({"fused": 2, "prefill": 1, "decode": 1})
    r.engines["fused-0"].draining = True
    r.engines["prefill-0"].draining = True       # a D with no P left prefills itself
    assert r.pick("disaggregated") == (r.engines["decode-0"], None)
    r.engines["fused-1"].draining = True
    r.engines["decode-0"].draining = True
    with pytest.raises(LookupError) as e:
        r.pick("")
    assert str(e.value) == (
        "no live engine can serve route any (''): decode-0 is draining; fused-0 is draining; "
        "fused-1 is draining; prefill-0 is draining")


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


def test_a_prompt_of_the_whole_context_is_refused_naming_the_prompt_not_max_tokens():
    """The decode slot needs a position in the context: the longest prompt
    is the context minus it, and one that long may still ask for a token."""
    cfg = ServeConfig.from_dict({"cluster": {"fused": 1},
                                 "engine": {"total_pages": 64, "page_size": 4,
                                            "max_context_tokens": 64}})
    r = Router(cfg, PrintableTokenizer(), 98, [("fused-0", "fused", "127.0.0.1:9")])
    sp = __import__("pdserve").SamplingParams(max_tokens=1)
    r.check_prompt([5] * 63, sp)
    with pytest.raises(RequestError, match="shorten the prompt") as e:
        r.check_prompt([5] * 64, sp)
    assert e.value.param == "prompt"


def test_two_thousand_calls_at_once_all_get_answered():
    """gRPC's server resets calls no handler has taken yet past 1,000 of them
    (a client saw CANCELLED): the router's server takes as many as
    router.max_requests allows in flight, and more."""
    import asyncio
    import collections

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.router.grpc_api import grpc_server

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
    from pdserve.kernels.models.loader import load_tokenizer
    from pdserve.cluster.actors import build_engine_server
    from pdserve.router.serve import serve

    cfg = ServeConfig.from_dict({"cluster": {"prefill": 1, "decode": 1},
                                 "router": {"max_body_bytes": 2000}})
    engines = [build_engine_server(cfg, role, 0) for role in ("prefill", "decode")]
    r = Router(cfg, load_tokenizer(None, "tiny"), 98,
               [(e.name, e.role.value, e.address) for e in engines])
    try:
        address = serve(r)
        with Client(address, timeout=60) as c:
            assert [e["alive"] for e in c.server_info()["engines"]] == [True, True]
            out = c.generate("Hello", max_tokens=40, ignore_eos=True)
        assert len(out.token_ids) == 40
    finally:
        r.stop()
        for e in engines:
            e.shutdown()


def test_membership_closes_an_engines_channel_when_it_moves_and_on_disconnect():
    # a channel left open past its loop delivers its last completions to a
    # closed loop (grpc.aio's "Event loop is closed" from the next loop)
    import asyncio

    import grpc

    from pdserve.router.engines import membership
    from pdserve.router.engines.pairing import EngineRef
    from pdserve.proto import control_pb2 as cpb

    async def closed(stub) -> bool:
        try:
            await stub.GetInfo(cpb.InfoRequest(), timeout=1)
        except grpc.aio.UsageError:
            return True
        except grpc.aio.AioRpcError:          # open: nothing answers there
            return False
        return False

    async def run():
        ref = EngineRef("decode-0", "decode", "")
        assert membership.connect(ref, "127.0.0.1:1") is None
        first = ref.stub
        # nothing answers at the old address; Ray's resolver says it moved
        await membership.refresh({ref.name: ref}, resolver=lambda name: "127.0.0.1:2")
        assert ref.address == "127.0.0.1:2" and ref.stub is not first
        assert await closed(first) and not await closed(ref.stub)
        current = ref.stub
        await membership.disconnect(ref)
        assert ref.channel is None and await closed(current)
        await membership.disconnect(ref)       # twice is harmless
    asyncio.run(run())


def test_a_generate_many_call_that_ends_during_a_write_still_sends_the_last_responses():
    """The client has sent its last request; while the call writes the
    request's first token, the request finishes and the call learns it is
    ending. The tokens and the finish queued meanwhile still go out before
    the call returns (the writer returned at once, and a request's last
    message was lost: CI saw 3 of 4 tokens)."""
    import asyncio
    from types import SimpleNamespace

    from pdserve.router.grpc_api import RouterServicer
    from pdserve.proto import router_pb2 as pb

    class Stream:
        id = "r1"
        task = None
        writing = None

        async def events(self):
            self.task = asyncio.current_task()     # the call's task for this request
            self.writing = asyncio.Event()
            for i in range(4):
                from pdserve.router.stream import Delta
                yield Delta([i], str(i), [], "length" if i == 3 else "", "fused-0")
                if i == 0:                          # the rest once the first is being written
                    await self.writing.wait()

    stream = Stream()
    front = SimpleNamespace(validate=lambda request: ([1, 2], None),
                            model_adapter=lambda model: None,
                            open=lambda ids, sp, route, rid, adapter: stream)

    class Context:
        def __init__(self):
            self.sent = []

        async def write(self, batch):
            if not self.sent:
                # hold the first write until the request has ended and the
                # call has heard of it (its done-callbacks run first)
                stream.writing.set()
                await asyncio.wait({stream.task})
            self.sent.append(batch)

    async def calls():
        yield pb.GenerateCall(tag=1, request=pb.GenerateRequest(token_ids=[1, 2]))

    async def go():
        ctx = Context()
        await asyncio.wait_for(RouterServicer(front).GenerateMany(calls(), ctx), 10)
        return [r for b in ctx.sent for r in b.responses]
    got = asyncio.run(go())
    assert [t for r in got for t in r.response.token_ids] == [0, 1, 2, 3]
    assert got[-1].response.finish_reason == "length"


def test_a_subscribe_stream_cancelled_under_the_link_is_a_broken_stream_not_its_end():
    """Membership closes an engine's channel when the engine moves (Ray
    restarted it elsewhere); grpc.aio then cancels the Subscribe call on it.
    The link takes that as a broken stream: its requests hear LOST and it
    subscribes again (the link's task died: requests hung, and the new
    incarnation was never subscribed). stop() still ends the link."""
    import asyncio

    from pdserve.router.engines.link import LOST, EngineLink
    from pdserve.router.engines.pairing import EngineRef
    from pdserve.router.mailbox import Mailbox
    from pdserve.proto import control_pb2 as cpb

    async def go():
        broke, again = asyncio.Event(), asyncio.Event()
        subs = []

        class Engine:
            async def GetInfo(self, req, timeout):      # the link's probe: healthy
                return cpb.InfoResponse()

            def Subscribe(self, req):
                subs.append(req.subscriber)
                first = len(subs) == 1

                async def events():
                    if not first:
                        again.set()
                    yield cpb.EngineEvents()
                    if first:
                        await broke.wait()
                        raise asyncio.CancelledError()   # the call, cancelled as its channel closes
                    await asyncio.Event().wait()
                return events()
        link = EngineLink(EngineRef("fused-0", "fused", "here", stub=Engine()), "router")
        link.start()
        await asyncio.wait_for(link.ready.wait(), 5)
        box = link.requests["r"] = Mailbox(asyncio.get_running_loop())
        broke.set()
        assert list(await asyncio.wait_for(box.take(), 5)) == [LOST]
        await asyncio.wait_for(again.wait(), 5)
        assert not link._task.done() and subs[0] != subs[1]
        link.stop()
        await asyncio.gather(link._task, return_exceptions=True)
        return link._task.cancelled()
    assert asyncio.run(go())


def test_an_added_engine_is_picked_only_once_it_is_subscribed_and_introduced():
    """The autoscaler adds an engine: it answers GetInfo (alive) before its
    events are subscribed and its peers told of it. Meanwhile it is not
    picked: a request then found no link for it (a 500 that left its load
    counted for good), or a D that had not met the new P refused it."""
    from pdserve.router.engines.pairing import EngineRef

    r = router({"fused": 0, "prefill": 1, "decode": 1})
    r.engines["decode-1"] = EngineRef("decode-1", "decode", "there", joining=True)
    r.engines["decode-1"].load = -10**9                 # the least loaded by far
    for _ in range(5):
        target, peer = r.pairing.pick("")
        assert target.name == "decode-0"
    r.engines["decode-1"].joining = False
    assert r.pairing.pick("")[0].name == "decode-1"


def test_security_takes_both_tls_files_or_neither():
    """A certificate without its key (or a key alone) is refused when the
    Security is made, not later in the gRPC front's thread."""
    with pytest.raises(ValueError, match="give both PEM files or neither"):
        Security(tls_cert="cert.pem")
    with pytest.raises(ValueError, match="give both PEM files or neither"):
        Security(tls_key="key.pem")
    assert Security(tls_cert="cert.pem", tls_key="key.pem").tls_key == "key.pem"


def test_an_abort_the_engine_no_longer_knows_is_too_late_not_accepted():
    # the engine finished the request while its last events were still on the
    # way: the stream ends finished, so the abort must not be reported as taken
    from pdserve.proto import control_pb2 as cpb

    class Engine:
        def __init__(self, knows):
            self.knows, self.asked = knows, []

        async def Abort(self, request, timeout):
            self.asked.append(request.request_id)
            return cpb.Ack(ok=self.knows, error="" if self.knows else "unknown request")

    r = router({"fused": 1})
    ref = r.engines["fused-0"]
    for knows in (True, False):
        ref.stub = Engine(knows)
        r.active["rid"] = (ref, None)
        assert asyncio.run(r.abort("rid")) is knows
        assert ref.stub.asked == ["rid"]
    del r.active["rid"]
    assert asyncio.run(r.abort("rid")) is False
