"""`pdserve bench tokens`: what one generated token costs on its way out of
an engine, by output length, beside the way it used to be done.

- loop thread (now): what the engine's loop thread does per token: the
  executor takes the token (`on_token`: stop ids, logprobs) and the round's
  handoff to the output thread (`Outputs.post`). No text.
- output thread (now): incremental detokenization, stop strings and the
  message to the router (`Outputs`), off the loop thread.
- loop thread (before): decoding the request's whole output after every
  token, on the loop thread (quadratic in the output's length).

The tokens are real text's (the tokenizer of `--model`, SmolLM2 by default),
repeated to the length asked for; one request, one token a round.
"""

from __future__ import annotations

import argparse
import time

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
    """Seconds per token on the loop thread: on_token, then one handoff."""
    from pdserve.kernels.sampling import SamplingParams
    from pdserve.roles.outputs import Outputs
    from pdserve.roles.torch_executor import TorchExecutor

    ex = TorchExecutor.__new__(TorchExecutor)         # the per-token state only, no model
    ex.detokenize, ex.tokenizer, ex.eos, ex.tracked = False, tok, {tok.eos_token_id}, {}
    ex.register("r", SamplingParams(max_tokens=None, stop=("never seen",)), 0)
    out = Outputs(tok, lambda rid: None)
    out.subscribe("s")
    out.open("r", "s", [1, 2, 3], ("never seen",))
    req, sent = _Req("r"), 0
    t0 = time.perf_counter()
    for t in ids:
        ex.on_token(req, t)
        req.output.append(t)
        item = ("r", req.output[sent:], (), None, None)
        sent = len(req.output)
        out.post([item])
    took = time.perf_counter() - t0
    out.close()
    return took / len(ids)


def _outputs_now(tok, ids) -> float:
    """Seconds per token in the output thread: text, stop strings, message."""
    from pdserve.roles.outputs import Outputs

    out = Outputs(tok, lambda rid: None)
    out.close()                                      # drive it here, in this thread
    q = out.subscribe("s")
    out._batch([("open", "r", "s", [1, 2, 3], ("never seen",), 0)])
    t0 = time.perf_counter()
    for t in ids:
        out._batch([("r", [t], (), None, None)])
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


def main(lengths=(64, 1000, 8000), model: str = "smollm2-135m") -> int:
    from pdserve.kernels.loader import load_tokenizer

    tok = load_tokenizer(None, model) if model in ("tiny", "smollm2-135m") else \
        load_tokenizer(model, None)
    print(f"per-token cost on the way out of an engine ({model} tokenizer), one request")
    print(f"{'output tokens':>13} {'loop now':>10} {'output thread':>14} {'loop before':>12} "
          f"{'before/now (loop)':>18}")
    for n in lengths:
        ids = _tokens(tok, n)
        now = min(_loop_now(tok, ids) for _ in range(3))
        outs = min(_outputs_now(tok, ids) for _ in range(3))
        before = min(_loop_before(tok, ids) for _ in range(1 if n > 2000 else 3))
        print(f"{n:>13,} {now * 1e6:>8.2f}us {outs * 1e6:>12.2f}us {before * 1e6:>10.1f}us "
              f"{before / now:>17.0f}x")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options."""


def run(args) -> int:
    return main()


if __name__ == "__main__":
    raise SystemExit(main())
