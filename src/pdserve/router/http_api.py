"""The OpenAI-compatible HTTP front of the router, on Starlette and uvicorn,
sharing the router's event loop with the gRPC front:

    GET  /v1/models            the served model
    POST /v1/completions       a prompt string, a list of them, or token ids
    POST /v1/chat/completions  messages rendered with the model's chat template
    GET  /v1/models/{model}    that model, or a 404 naming the one served
    POST /tokenize             a prompt or chat messages as token ids (vLLM's)
    POST /detokenize           token ids as text (vLLM's)
    GET  /version              pdserve's version
    GET  /health               200 while some engine can serve, else 503
    GET  /metrics              Prometheus text (router/metrics.py)

Errors are OpenAI's error body (openai_answers.py, with the answers
themselves); bad input is a 400 that names the field, never a 500. A client
that disconnects mid-request (streamed or not) aborts its request on the
engines. Why Starlette and not FastAPI: FastAPI's additions are automatic
validation and generated docs; the OpenAI error bodies need our own
validation step anyway (pydantic, openai_protocol.py), so FastAPI would only
add work to every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid

import pydantic
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.router.lora import admin as lora_admin
from pdserve.router.auth import key_matches, refusal
from pdserve.router.errors import RequestError
from pdserve.router.openai_answers import Answers, error, from_request_error
from pdserve.router.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoraAdapterRequest,
    TokenizeRequest, Unsupported)
from pdserve.router.router import Router

OPEN_PATHS = ("/health", "/metrics")
COMPLETION_DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions

# what render_chat sets itself: chat_template_kwargs may not set these
_TEMPLATE_ARGS = {"template", "messages", "add_generation_prompt", "bos_token", "eos_token",
                  "continue_final_message"}


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def _from_validation(e: pydantic.ValidationError) -> JSONResponse:
    first = e.errors()[0]
    # a union's member types show in the location (prompt.list[int]): keep field names
    loc = ".".join(str(x) for x in first["loc"]
                   if not (isinstance(x, str) and ("[" in x or x in _TYPE_NAMES)))
    got = first.get("input")
    shown = json.dumps(got)[:80] if isinstance(got, (int, float, str, bool)) or got is None \
        else f"a list of {len(got)}" if isinstance(got, list) else type(got).__name__
    if first["type"] == "missing":
        return error(400, f"{loc} is required", loc or None)
    msg = first["msg"].removeprefix("Value error, ")
    if not loc:                     # a check across fields: its message names them
        return error(400, msg)
    return error(400, f"{loc}: {msg} (got {shown})", loc)


def _misspelt(data: dict, fields) -> tuple[str, str] | None:
    """(key, the field it is a near miss of) for the first unknown key that
    reads like a typo of a field (max_token, temprature). Other unknown keys
    are ignored, as OpenAI clients send many; a typo would silently fall back
    to the field's default."""
    import difflib

    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1, cutoff=0.85)
            if close:
                return key, close[0]
    return None


class HttpFront:
    def __init__(self, router: Router):
        self.r = router
        self.answers = Answers(router.model_name, router.tokenizer)

    # ---- plumbing ------------------------------------------------------------
    def _auth(self, request: Request) -> JSONResponse | None:
        key = self.r.security.api_key
        if not key:
            return None
        if request.url.path in OPEN_PATHS and not self.r.cfg.router.protect_metrics:
            return None
        header = request.headers.get("authorization")
        if key_matches(header, key):
            return None
        return error(401, refusal(header, "the header 'Authorization: Bearer <key>'"))

    async def _body(self, request: Request, model_cls):
        """The request body as `model_cls`, or an error response (the API
        key checked first)."""
        if (denied := self._auth(request)) is not None:
            return None, denied
        limit = self.r.cfg.router.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            return None, error(413, f"the request body of {int(declared):,} bytes exceeds this "
                               f"deployment's limit of {limit:,} (router.max_body_bytes)")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None, error(413, f"the request body exceeds this deployment's limit of "
                                   f"{limit:,} bytes (router.max_body_bytes)")
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            return None, error(400, f"the request body is not valid JSON: {e}")
        if not isinstance(data, dict):
            return None, error(400, "the request body must be a JSON object")
        typo = _misspelt(data, model_cls.model_fields)
        if typo is not None:
            key, known = typo
            return None, error(400, f"unknown field {key!r}; did you mean {known!r}? (fields "
                               "pdserve does not know are otherwise ignored)", key)
        try:
            body = model_cls.model_validate(data)
            body.check_unsupported()
        except pydantic.ValidationError as e:
            return None, _from_validation(e)
        except Unsupported as e:
            return None, error(400, str(e), e.param)
        try:
            self.r.model_adapter(body.model)
        except RequestError as e:
            return None, error(404, e.message, "model", "model_not_found")
        return body, None

    def _open(self, prompts: list[list[int]], body, max_tokens, logprobs, rid: str, route):
        """One stream per (prompt, choice): every prompt checked and the
        router's room for all of them taken first, so all or none open."""
        sp = body.sampling(max_tokens, logprobs)
        adapter = self.r.model_adapter(body.model)
        field = "prompt" if isinstance(body, CompletionRequest) else "messages"
        for p, ids in enumerate(prompts):
            self.r.check_prompt(ids, sp, f"{field}[{p}]" if len(prompts) > 1 else field)
        self.r.admit(len(prompts) * body.n, route)
        streams = []
        try:
            for p, ids in enumerate(prompts):
                for j in range(body.n):
                    # choice j of n draws with seed + j: the choices differ, each reproducible
                    choice = _with_seed(sp, (sp.seed + j) % (1 << 64)) \
                        if sp.seed is not None and j else sp
                    streams.append(self.r.stream(ids, choice, route, f"{rid}-{p * body.n + j}",
                                                 adapter))
        except BaseException:
            for s in streams:
                self.r.active.pop(s.id, None)
            raise
        return streams

    # ---- endpoints ---------------------------------------------------------------
    def _model_card(self, adapter=None) -> dict:
        """The base model's card, or a LoRA adapter's (its parent: the base)."""
        card = {"id": self.r.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "pdserve", "root": self.r.model_name, "parent": None,
                "max_model_len": self.r.cfg.engine.max_context_tokens}
        if adapter is not None:
            card.update(id=adapter.name, root=adapter.path, parent=self.r.model_name)
        return card

    async def models(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [self._model_card()] + [
            self._model_card(a) for a in self.r.adapters.refs()]})

    async def load_lora_adapter(self, request: Request):
        """Load an adapter on every engine (lora.runtime_updates); answers once
        `model` may name it."""
        body, err = await self._body(request, LoadLoraAdapterRequest)
        if err is not None:
            return err
        try:
            ref = await lora_admin.load(self.r, body.lora_name, body.lora_path or "",
                                        body.pinned)
        except RequestError as e:
            return from_request_error(e)
        return JSONResponse({"object": "lora_adapter", "lora_name": ref.name, "id": ref.id,
                             "status": "loaded"})

    async def unload_lora_adapter(self, request: Request):
        """Unload an adapter; answers once the requests under it have ended."""
        body, err = await self._body(request, LoadLoraAdapterRequest)
        if err is not None:
            return err
        try:
            ref = await lora_admin.unload(self.r, body.lora_name)
        except RequestError as e:
            return from_request_error(e)
        return JSONResponse({"object": "lora_adapter", "lora_name": ref.name, "id": ref.id,
                             "status": "unloaded"})

    async def model(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        name = request.path_params["model"]
        try:
            adapter = self.r.model_adapter(name)
        except RequestError as e:
            return error(404, e.message, "model", "model_not_found")
        return JSONResponse(self._model_card(adapter))

    async def version(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        import pdserve

        return JSONResponse({"version": pdserve.__version__})

    async def tokenize(self, request: Request):
        body, err = await self._body(request, TokenizeRequest)
        if err is not None:
            return err
        try:
            if body.messages is not None:
                ids = self._chat_ids(body, add_special_tokens=bool(body.add_special_tokens))
            else:
                special = body.add_special_tokens is not False
                ids = self.r.encode(body.prompt, "prompt", add_special_tokens=special)
        except Unsupported as e:
            return error(400, str(e), e.param)
        except ValueError as e:                      # the template failed on these messages
            return error(400, f"messages: {e}", "messages")
        except RequestError as e:
            return from_request_error(e)
        return JSONResponse({"count": len(ids), "max_model_len":
                             self.r.cfg.engine.max_context_tokens, "tokens": ids})

    async def detokenize(self, request: Request):
        body, err = await self._body(request, DetokenizeRequest)
        if err is not None:
            return err
        bad = next((t for t in body.tokens if not 0 <= t < self.r.vocab_size), None)
        if bad is not None:
            return error(400, f"token id {bad} is outside the vocabulary "
                         f"[0, {self.r.vocab_size})", "tokens")
        return JSONResponse({"prompt": self.r.tokenizer.decode(body.tokens)})

    async def health(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        try:
            self.r.pairing.candidates("")
        except LookupError as e:
            return JSONResponse({"status": "unavailable", "reason": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request):
        if (denied := self._auth(request)) is not None:
            return denied
        text = self.r.metrics.render(await self.r.engine_stats(), self.r.engines.values())
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request):
        body, err = await self._body(request, CompletionRequest)
        if err is not None:
            return err
        try:
            prompts = [self.r.encode(p) if isinstance(p, str) else p for p in body.prompts()]
            max_tokens = body.max_tokens if body.max_tokens is not None \
                else COMPLETION_DEFAULT_MAX_TOKENS
            rid = f"cmpl-{uuid.uuid4().hex}"
            streams = self._open(prompts, body, max_tokens, body.logprobs, rid, body.route)
        except Unsupported as e:
            return error(400, str(e), e.param)
        except RequestError as e:
            return from_request_error(e)
        # echo: each choice's text starts with its prompt's (token ids: decoded)
        echo = [p if isinstance(p, str) else self.r.tokenizer.decode(ids)
                for p, ids in zip(body.prompts(), prompts)] if body.echo else None
        return await self.answers.respond(request, body, streams, rid, prompts, chat=False,
                                   echo=echo)

    async def chat(self, request: Request):
        body, err = await self._body(request, ChatCompletionRequest)
        if err is not None:
            return err
        try:
            ids = self._chat_ids(body)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            streams = self._open([ids], body, body.token_limit, body.logprobs_k, rid,
                                 body.route)
        except Unsupported as e:
            return error(400, str(e), e.param)
        except ValueError as e:                      # the template failed on these messages
            return error(400, f"messages: {e}", "messages")
        except RequestError as e:
            return from_request_error(e)
        return await self.answers.respond(request, body, streams, rid, [ids], chat=True)

    def _chat_ids(self, body, add_special_tokens: bool = False) -> list[int]:
        """The body's messages rendered with the model's chat template, as
        token ids (the template writes its own BOS: none is added)."""
        template = getattr(self.r.tokenizer, "chat_template", None)
        if not template:
            raise Unsupported("messages", f"model {self.r.model_name!r} has no chat template; "
                              "use /v1/completions with a prompt")
        from pdserve.text.chat import render_chat
        from pdserve.text.tools import render_messages

        messages = [{**m.model_dump(exclude_none=True), "content": m.text()}
                    for m in body.messages]
        extra = body.chat_template_kwargs or {}
        if clash := sorted(set(extra) & _TEMPLATE_ARGS):
            raise Unsupported("chat_template_kwargs", f"chat_template_kwargs sets {clash}, "
                              "which the request itself sets; use the request's own fields")
        # tools, and tool calls and results, as the template reads them (text/tools.py)
        use = body.tool_use() if hasattr(body, "tool_use") else None
        messages, tools = render_messages(messages, use, template)
        extra = {**extra, **tools}
        text = render_chat(template, messages, body.add_generation_prompt,
                           bos_token=getattr(self.r.tokenizer, "bos_token", None),
                           eos_token=getattr(self.r.tokenizer, "eos_token", None),
                           continue_final_message=body.continue_final_message, **extra)
        return self.r.encode(text, "messages", add_special_tokens=add_special_tokens)

def _with_seed(sp, seed):
    import dataclasses

    return dataclasses.replace(sp, seed=seed)


def build_app(router: Router) -> Starlette:
    front = HttpFront(router)

    async def http_error(request, exc: HTTPException):
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return Starlette(routes=[
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/v1/models/{model:path}", front.model, methods=["GET"]),
        Route("/tokenize", front.tokenize, methods=["POST"]),
        Route("/detokenize", front.detokenize, methods=["POST"]),
        Route("/version", front.version, methods=["GET"]),
        Route("/v1/load_lora_adapter", front.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", front.unload_lora_adapter, methods=["POST"]),
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat, methods=["POST"]),
        Route("/health", front.health, methods=["GET"]),
        Route("/metrics", front.metrics, methods=["GET"]),
    # Starlette calls a handler only for its own class, which its types cannot say
    ], exception_handlers={HTTPException: http_error})  # type: ignore[dict-item]


class HttpServer:
    """The HTTP front on uvicorn, as one of the router's fronts (router.Front)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.address: str | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def open(self, router: Router) -> None:
        """Serve on the running loop; returns once bound."""
        host, sec = self.host, router.security
        config = uvicorn.Config(build_app(router), host=host, port=self.port,
                                log_level="warning", access_log=False, lifespan="off",
                                ssl_certfile=sec.tls_cert, ssl_keyfile=sec.tls_key,
                                timeout_graceful_shutdown=2)
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on such connections, and
        # without it a stream's first event waits out the client's delayed ACK (~40 ms)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if router.cfg.router.replicas > 1:          # the replicas share the port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, self.port))
        server = self._server = uvicorn.Server(config)
        task = self._task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()                           # raises what stopped it
                raise RuntimeError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)
        scheme = "https" if sec.tls_cert else "http"
        self.address = f"{scheme}://{host}:{sock.getsockname()[1]}"

    async def close(self) -> None:
        if self._server is None or self._task is None:   # never opened: nothing to stop
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, 10)
