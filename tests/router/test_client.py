"""The async client's multiplexed mode (`pdserve.client.Multiplexed`, what
`AsyncClient(multiplex=True)` runs) against a scripted GenerateMany, no
router: a call that breaks fails what was in flight and the next request
opens a new one; a request left early is cancelled on its call."""

import asyncio

import grpc
import pytest

from pdserve.client import Multiplexed, RequestFailed
from pdserve.proto import router_pb2 as pb


def _token(tag: int, finish: str = "") -> pb.GenerateBatch:
    return pb.GenerateBatch(responses=[pb.TaggedResponse(
        tag=tag, response=pb.GenerateResponse(token_ids=[7], text="x", finish_reason=finish))])


class ScriptedRouter:
    """Each GenerateMany call answers each request with one token, then
    the finish if max_tokens is 2, else nothing more. `break_after`: the
    first call fails (UNAVAILABLE) after its first token."""

    def __init__(self, break_after: bool = False):
        self.break_after = break_after
        self.calls: list[list] = []
        self.cancelled = asyncio.Event()

    def GenerateMany(self, requests, metadata=None):
        got: list = []
        self.calls.append(got)
        first = len(self.calls) == 1

        async def responses():
            async for call in requests:
                got.append(call)
                if call.cancel:
                    self.cancelled.set()
                    continue
                yield _token(call.tag)
                if first and self.break_after:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE,
                                               grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details="the router went away")
                if call.request.sampling.max_tokens == 2:
                    yield _token(call.tag, "length")
        return responses()


def _request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=[1, 2], sampling=pb.SamplingOptions(max_tokens=max_tokens))


async def _generate(many: Multiplexed, max_tokens: int, timeout=None) -> list:
    return [c async for c in many.stream(_request(max_tokens), timeout)]


def test_a_broken_call_fails_what_was_in_flight_and_the_next_request_reopens():
    router = ScriptedRouter(break_after=True)

    async def go():
        many = Multiplexed(router, None)
        chunks = []
        with pytest.raises(RequestFailed) as e:
            async for chunk in many.stream(_request(2), None):
                chunks.append(chunk)
        again = await asyncio.wait_for(_generate(many, 2), 10)
        await many.close()
        return chunks, e.value, again
    chunks, err, again = asyncio.run(go())
    assert [ch.token_ids for ch in chunks] == [[7]]          # what came before the break
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "went away" in err.details()
    assert [ch.token_ids for ch in again] == [[7], [7]] and again[-1].finish_reason == "length"
    assert len(router.calls) == 2                             # a new call for the new request


def test_a_request_left_early_is_cancelled_by_its_tag_and_the_call_goes_on():
    router = ScriptedRouter()

    async def go():
        many = Multiplexed(router, None)
        async for _ in many.stream(_request(100), None):
            break                                             # leave after the first token
        await asyncio.wait_for(router.cancelled.wait(), 10)
        done = await asyncio.wait_for(_generate(many, 2), 10)
        await many.close()
        return done
    done = asyncio.run(go())
    calls = router.calls[0]
    assert [(m.tag, m.cancel) for m in calls] == [(1, False), (1, True), (2, False)]
    assert len(done) == 2 and len(router.calls) == 1


def test_the_client_timeout_ends_a_request_with_deadline_exceeded_and_cancels_it():
    router = ScriptedRouter()

    async def go():
        many = Multiplexed(router, None)
        with pytest.raises(RequestFailed) as e:
            await _generate(many, 100, timeout=0.2)           # never finishes
        await asyncio.wait_for(router.cancelled.wait(), 10)
        await many.close()
        return e.value
    err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "0.2 s" in err.details()


def test_a_request_whose_answer_came_whole_does_not_fail_on_what_queued_behind_it():
    """The router writes a request's last response and ends the call at
    once: the call's end reaches the request's mailbox behind its final
    response, before the request reads either. The request ends with its
    answer; the call's end behind it is stale (it raised UNAVAILABLE after
    the final chunk, and generate() threw the whole answer away). A
    timeout firing in that moment is stale the same way."""

    class EndsAtOnce:
        def GenerateMany(self, requests, metadata=None):
            async def responses():
                call = await anext(requests)
                yield _token(call.tag, "length")
            return responses()

    async def go():
        many = Multiplexed(EndsAtOnce(), None)
        return await asyncio.wait_for(_generate(many, 1), 10)
    chunks = asyncio.run(go())
    assert [(ch.token_ids, ch.finish_reason) for ch in chunks] == [([7], "length")]
