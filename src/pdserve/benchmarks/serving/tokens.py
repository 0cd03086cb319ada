"""`pdserve bench tokens`: what one generated token costs on its way out of
an engine, by output length, beside the way it used to be done.

- loop thread (now): what the engine's loop thread does per token: the
  executor takes the token (`on_token`: stop ids, logprobs) and the round's
  handoff to the output thread (`Outputs.post`). No text.
- output thread (now): incremental detokenization, stop strings and the
  message to the router (`Outputs`), off the loop thread.
- loop thread (before): decoding the request's whole output after every
  token, on the loop thread (quadratic in the output's length).
- router, gRPC and HTTP: what the router's process does per token once the
  engine's event has arrived: the request's mailbox, its stream (deltas,
  metrics), and the front's message (a GenerateResponse; an SSE event of
  the OpenAI API). A stand-in for the engine link hands one event a round
  to a real `Router`; the wire (protobuf parsing, the socket) is not in it.

The tokens are real text's (the tokenizer of `--model`, SmolLM2 by default),
repeated to the length asked for; one request, one token a round.
"""

from __future__ import annotations

import argparse
import time

from pdserve.benchmarks.common.options import positive

TEXT = ("Disaggregated serving splits the prefill of a prompt from the decoding of its "
        "answer, so that each runs on the engine that suits it: prefill is compute-bound, "
        "decode is memory-bound. Pages of the KV cache move from one to the other over NIXL, "
        "and stay pinned on the prefill side until the decode side acknowledges them. ")


class _Req:
    __slots__ = ("id", "output", "finish_reason")

    def __init__(self, rid):
        self.id, self.output, self.finish_reason = rid, [], None


def _tokens(tok, n: int) -> list[int]:
    ids = tok.encode(TEXT * 4, add_special_tokens=False)
    return (ids * (n // len(ids) + 1))[:n]


def _loop_now(tok, ids) -> float:
    """CPU seconds per token on the loop thread: on_token, then one handoff."""
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.engine.outputs import OutputItem, Outputs
    from pdserve.engine.executor.torch_executor import TorchExecutor

    ex = TorchExecutor.__new__(TorchExecutor)         # the per-token state only, no model
    ex.detokenize, ex.tokenizer, ex.eos, ex.tracked = False, tok, {tok.eos_token_id}, {}
    ex.register("r", SamplingParams(max_tokens=None, stop=("never seen",)), 0)
    out = Outputs(tok, lambda rid, key: None)
    out.subscribe("s")
    out.open("r", "s", [1, 2, 3], SamplingParams(stop=("never seen",)))
    req, sent = _Req("r"), 0
    # this thread's CPU: the output thread runs beside it, as in an engine, and
    # the wall clock would count the waits for its GIL as the loop's cost
    t0 = time.thread_time()
    for t in ids:
        ex.on_token(req, t)
        req.output.append(t)
        item = OutputItem("r", req.output[sent:])
        sent = len(req.output)
        out.post([item])
    took = time.thread_time() - t0
    out.close()
    return took / len(ids)


def _outputs_now(tok, ids) -> float:
    """Seconds per token in the output thread: text, stop strings, message."""
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.engine.outputs import OutputItem, Outputs

    out = Outputs(tok, lambda rid, key: None)
    out.close()                                      # drive it here, in this thread
    q = out.subscribe("s")
    out.open("r", "s", [1, 2, 3], SamplingParams(stop=("never seen",)))
    out._batch(out._in.get_nowait())                 # the open, as open() queued it
    t0 = time.perf_counter()
    for t in ids:
        out._batch([OutputItem("r", [t])])
    took = time.perf_counter() - t0
    while not q.empty():
        q.get_nowait()
    return took / len(ids)


def _loop_before(tok, ids) -> float:
    """The old way: the whole output decoded after every token."""
    output, text_sent = [], ""
    t0 = time.perf_counter()
    for t in ids:
        output.append(t)
        text = tok.decode(output)
        _ = text[len(text_sent):] if text.startswith(text_sent) else text
        text_sent = text
    return (time.perf_counter() - t0) / len(ids)


class _Stub:
    """The engine's side of Submit and Abort: accepted at once."""

    async def Submit(self, request, timeout=None):
        return None

    async def Abort(self, request, timeout=None):
        return None


def _router_now(tok, ids, front: str) -> float:
    """Process CPU seconds per token in a real Router (one fused engine
    whose link is a stand-in), from the event's arrival to the front's
    message, for one request that streams `ids` one token a round."""
    from pdserve.config import ServeConfig
    from pdserve.router.event_loop import run
    from pdserve.router.router import Router
    from pdserve.proto import control_pb2 as cpb

    cfg = ServeConfig.from_dict({"cluster": {"fused": 1}})
    r = Router(cfg, tok, 1 << 20, [("fused-0", "fused", "127.0.0.1:9")])
    r.engines["fused-0"].stub = _Stub()
    events = [cpb.RequestEvent(request_id="", token_ids=[t], text=tok.decode([t])) for t in ids]
    events[-1].finish_reason = "length"
    return run(_stream_events(r, front, ids[:8], events)) / len(ids)


async def _stream_events(r, front: str, prompt: list[int], events: list) -> float:
    """Process CPU seconds the router takes to hand `events`, one a round,
    to the stream of a request of `prompt` at `front` and out as messages."""
    import asyncio
    import contextlib

    from pdserve.router.engines.link import EngineLink

    link = r.links["fused-0"] = EngineLink(r.engines["fused-0"], r.id)
    link.subscriber = "s"
    link.ready.set()
    out = _front_messages(r, front, prompt, len(events))
    got = 0

    async def read():
        nonlocal got
        async with contextlib.aclosing(out) as messages:
            async for _ in messages:
                got += 1
    reader = asyncio.ensure_future(read())
    rid, box = await _submitted(link, reader)
    t0 = time.process_time()
    for ev in events:
        ev.request_id = rid
        box.put(ev)
        while box.pending():                 # one round: the stream takes its event
            if reader.done():
                break
            await asyncio.sleep(0)
    await asyncio.wait_for(reader, 60)
    took = time.process_time() - t0
    if got < len(events):
        raise RuntimeError(f"the router streamed {got} messages for {len(events)} tokens")
    return took


def _front_messages(r, front: str, prompt: list[int], n: int):
    """The messages a request of `prompt` for `n` tokens gets from `front`:
    gRPC GenerateResponses, or the OpenAI API's SSE events."""
    from pdserve.proto import router_pb2 as pb

    if front == "grpc":
        from pdserve.router.grpc_api import RouterServicer

        return RouterServicer(r)._responses(pb.GenerateRequest(
            token_ids=prompt, sampling=pb.SamplingOptions(max_tokens=n)))
    from pdserve.router.http_api import HttpFront
    from pdserve.router.openai_protocol import CompletionRequest
    from pdserve.text.sampling_params import SamplingParams

    body = CompletionRequest(prompt=prompt, max_tokens=n, stream=True)
    stream = r.open(prompt, SamplingParams(max_tokens=n))
    return HttpFront(r).answers.sse(body, [stream], "cmpl", 0, len(prompt), chat=False)


async def _submitted(link, reader) -> tuple:
    """(request id, its mailbox) once the stream has submitted its request;
    the reader's own error if it failed first."""
    import asyncio

    for _ in range(1000):                    # until the stream has submitted
        if link.requests or reader.done():
            break
        await asyncio.sleep(0)
    if reader.done():                        # it failed: say why
        reader.result()
    if not link.requests:
        raise RuntimeError("the router's stream never submitted its request")
    (rid, box), = link.requests.items()
    return rid, box


def main(lengths=(64, 1000, 8000), model: str = "smollm2-135m") -> int:
    from pdserve.kernels.models.loader import load_tokenizer

    tok = load_tokenizer(None, model) if model in ("tiny", "smollm2-135m") else \
        load_tokenizer(model, None)
    print(f"per-token cost on the way out of an engine ({model} tokenizer), one request")
    print(f"{'output tokens':>13} {'loop now':>10} {'output thread':>14} {'loop before':>12} "
          f"{'before/now (loop)':>18} {'router gRPC':>12} {'router HTTP':>12}")
    for n in lengths:
        ids = _tokens(tok, n)
        now = min(_loop_now(tok, ids) for _ in range(5))
        outs = min(_outputs_now(tok, ids) for _ in range(3))
        before = min(_loop_before(tok, ids) for _ in range(1 if n > 2000 else 3))
        grpc = min(_router_now(tok, ids, "grpc") for _ in range(3))
        http = min(_router_now(tok, ids, "http") for _ in range(3))
        print(f"{n:>13,} {now * 1e6:>8.2f}us {outs * 1e6:>12.2f}us {before * 1e6:>10.1f}us "
              f"{before / now:>17.0f}x {grpc * 1e6:>10.2f}us {http * 1e6:>10.2f}us")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=positive, nargs="+", default=[64, 1000, 8000],
                   help="output lengths, one row each (64 1000 8000)")
    p.add_argument("--model", default="smollm2-135m",
                   help="whose tokenizer: a preset (smollm2-135m, tiny) or a checkpoint path")


def run(args) -> int:
    return main(tuple(args.lengths), args.model)


if __name__ == "__main__":
    raise SystemExit(main())
