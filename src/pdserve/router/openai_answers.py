"""The OpenAI wire format of an answer: error bodies ({"error": {"message",
"type", "param", "code"}}, a RequestError's kind as its HTTP status), a
completion or chat completion whole or as server-sent events, and the
logprobs and usage objects in them. The request's side is
openai_protocol.py's; the routes that answer are http_api.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pdserve.router import openai_tools
from pdserve.router.errors import ErrorKind, RequestError
from pdserve.text.tools import ToolFormat, ToolUse
from pdserve.router.merge import collect, merged

STATUS = {ErrorKind.INVALID: 400, ErrorKind.EXISTS: 409, ErrorKind.OVERLOADED: 429,
          ErrorKind.UNAVAILABLE: 503, ErrorKind.ABORTED: 499, ErrorKind.INTERNAL: 500,
          ErrorKind.NOT_FOUND: 404, ErrorKind.PRECONDITION: 409}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_error", 499: "aborted",
         500: "server_error", 503: "service_unavailable"}


def error(status: int, message: str, param: str | None = None, code=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": TYPES.get(status, "error"),
                                   "param": param, "code": code if code is not None else status}},
                        status_code=status)


def from_request_error(e: RequestError) -> JSONResponse:
    return error(STATUS[e.kind], e.message, e.param)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens the engines
    found in a prefix cache (device, host or disk), as OpenAI reports them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Answers:
    """The answers of one served model: its name heads each, its tokenizer
    names the tokens logprobs score."""

    def __init__(self, model_name: str, tokenizer):
        self.model_name = model_name
        self.tokenizer = tokenizer

    def _tok_str(self, token_id: int) -> str:
        # a logprob names the token it scores: an end of turn is '<|im_end|>', not ''
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def respond(self, request: Request, body, streams, rid, prompts, chat: bool,
                      echo=None) -> Response:
        """The answer to `body` from its choices' `streams`: server-sent
        events if it asked for a stream, else the whole answer once every
        choice ended (a 499 if the client left first: the engines abort).
        `echo`: per prompt, the text each of its choices starts with."""
        created = int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)      # once a prompt, whatever n is
        if body.stream:
            gen = self.sse(body, streams, rid, created, prompt_tokens, chat, echo)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collecting = asyncio.ensure_future(collect(streams))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait([collecting, gone], return_when=asyncio.FIRST_COMPLETED)
        if not collecting.done():                    # the client left: abort on the engines
            collecting.cancel()
            with contextlib.suppress(BaseException):
                await collecting
            return Response(status_code=499)
        gone.cancel()
        try:
            results = collecting.result()
        except RequestError as e:
            return from_request_error(e)
        choices, completion_tokens = [], 0
        tools = self._tools(body) if chat else None
        for i, res in enumerate(results):
            completion_tokens += len(res.token_ids)
            lps = self.logprobs(res.logprobs, chat, 0) if res.logprobs is not None else None
            if chat and tools is not None:
                msg, finish = openai_tools.message(tools[0], tools[1], res.text,
                                                   res.finish_reason)
                choices.append({"index": i, "message": msg, "logprobs": lps,
                                "finish_reason": finish})
            elif chat:
                choices.append({"index": i, "message": {"role": "assistant",
                                                         "content": res.text},
                                "logprobs": lps, "finish_reason": res.finish_reason})
            else:
                text = echo[i // body.n] + res.text if echo else res.text
                choices.append({"index": i, "text": text, "logprobs": lps,
                                "finish_reason": res.finish_reason})
        # once a prompt, like prompt_tokens: its first choice's
        cached = sum(r.cached_tokens for i, r in enumerate(results) if i % body.n == 0)
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": body.model or self.model_name, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached)})

    async def sse(self, body, streams, rid, created, prompt_tokens, chat: bool, echo=None):
        """The answer's server-sent events, as bytes: a role event per chat
        choice, the echoed prompts, every delta, the usage if asked for; an
        error ends it as an error event; then [DONE]."""
        ev = SseEvents({"id": rid, "object": "chat.completion.chunk" if chat
                        else "text_completion", "created": created,
                        "model": body.model or self.model_name}, chat, body.include_usage)
        completion_tokens = 0
        offsets = [0] * len(streams)
        cached = [0] * len(streams)
        want_lps = streams[0].sp.logprobs is not None
        tools = self._tools(body) if chat else None
        calls = [openai_tools.ToolDeltas(*tools) for _ in streams] if tools else None

        def render(i, d) -> bytes:
            nonlocal completion_tokens
            completion_tokens += len(d.token_ids)
            cached[i] = d.cached_tokens or cached[i]
            if calls is not None:           # tool calls: their own deltas (openai_tools.py)
                return self._tool_events(ev, i, calls[i], d, want_lps, offsets)
            # one event a delta, even while its text is held back (part of a
            # character, or of a possible stop string): streams stay token by token
            at, offsets[i] = offsets[i], offsets[i] + len(d.text)
            if not want_lps and not d.finish_reason:
                return ev.text(i, d.text)
            lps = self.logprobs(d.logprobs, chat, at) if want_lps and d.logprobs else None
            finish = d.finish_reason or None
            if chat:
                return ev.choice({"index": i, "delta": {"content": d.text} if d.text else {},
                                  "logprobs": lps, "finish_reason": finish})
            return ev.choice({"index": i, "text": d.text, "logprobs": lps,
                              "finish_reason": finish})
        try:
            if chat:
                for i in range(len(streams)):
                    yield ev.choice({"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None})
            for i in range(len(streams) if echo else 0):     # the prompt first
                yield ev.text(i, echo[i // body.n])
            if len(streams) == 1:                 # no merging layer: this runs every token
                async with contextlib.aclosing(streams[0].events()) as deltas:
                    async for d in deltas:
                        yield render(0, d)
            else:
                async for i, d in merged(streams):
                    yield render(i, d)
            if body.include_usage:
                yield ev.usage(usage(prompt_tokens, completion_tokens, sum(cached[::body.n])))
        except RequestError as e:
            yield b"data: " + from_request_error(e).body + b"\n\n"
        yield b"data: [DONE]\n\n"

    def _tools(self, body) -> tuple[ToolUse, ToolFormat] | None:
        """(ToolUse, the model's ToolFormat) where the request's tools are
        in play (None: plain content)."""
        use = body.tool_use() if hasattr(body, "tool_use") else None
        if use is None or not use.rendered:
            return None
        return use, ToolFormat.of_template(getattr(self.tokenizer, "chat_template", None))

    def _tool_events(self, ev, i: int, calls, d, want_lps: bool, offsets) -> bytes:
        deltas, finish = calls.push(d.text, d.finish_reason or None)
        at, offsets[i] = offsets[i], offsets[i] + len(d.text)
        lps = self.logprobs(d.logprobs, True, at) if want_lps and d.logprobs else None
        if not deltas:
            deltas = [{}]
        out = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            out.append(ev.choice({"index": i, "delta": delta, "logprobs": lps if last else None,
                                  "finish_reason": finish if last else None}))
        return b"".join(out)

    def logprobs(self, entries, chat: bool, offset: int):
        """OpenAI's logprobs object for these TokenLogprob entries: chat's
        {"content": [...]} or the completions API's parallel lists."""
        if chat:
            content = []
            for e in entries:
                s = self._tok_str(e.token_id)
                content.append({"token": s, "logprob": e.logprob, "bytes": list(s.encode()),
                                "top_logprobs": [
                                    {"token": (t := self._tok_str(x.token_id)),
                                     "logprob": x.logprob, "bytes": list(t.encode())}
                                    for x in e.top]})
            return {"content": content}
        tokens, offsets, top = [], [], []
        for e in entries:
            s = self._tok_str(e.token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            # the sampled token is always among them (OpenAI: up to logprobs + 1)
            top.append({**{self._tok_str(x.token_id): x.logprob for x in e.top}, s: e.logprob})
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": top, "text_offset": offsets}


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SseEvents:
    """The server-sent events of one streamed answer, as bytes. The common
    event (a delta's text, no logprobs, not the last) is spliced from a
    prefix and a suffix rendered once around the JSON-escaped text: dumping
    the whole chunk object for every token was a tenth of the router's time
    under load. Every other event is dumped whole (`choice`)."""

    __slots__ = ("head", "usage_field", "_chat", "_pre", "_mid", "_end")

    def __init__(self, head: dict, chat: bool, include_usage: bool):
        self.head = head
        self.usage_field = {"usage": None} if include_usage else {}
        self._pre = b"data: " + json.dumps(head)[:-1].encode() + b', "choices": [{"index": '
        self._mid = b', "delta": {"content": ' if chat else b', "text": '
        self._end = ((b"}" if chat else b"") + b', "logprobs": null, "finish_reason": null}]'
                     + (b', "usage": null' if include_usage else b"") + b"}\n\n")
        self._chat = chat

    def text(self, index: int, text: str) -> bytes:
        if not text and self._chat:               # an empty chat delta is {}
            return self.choice({"index": index, "delta": {}, "logprobs": None,
                                "finish_reason": None})
        return b"".join((self._pre, b"%d" % index, self._mid, json.dumps(text).encode(),
                         self._end))

    def choice(self, choice: dict) -> bytes:
        return b"data: " + json.dumps({**self.head, "choices": [choice],
                                       **self.usage_field}).encode() + b"\n\n"

    def usage(self, usage: dict) -> bytes:
        return b"data: " + json.dumps({**self.head, "choices": [], "usage": usage}).encode() \
            + b"\n\n"
