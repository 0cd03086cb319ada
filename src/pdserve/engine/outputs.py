"""What an engine sends its routers, off the loop thread.

The loop thread hands each round's raw results to `Outputs.post`: one queue
put a round, whatever the batch. The output thread turns token ids into
text (an incremental Detokenizer per request: constant work per token),
finds stop strings, groups the round's events by the router that submitted
each request (its subscription), and queues one message per router. A stop
string ends a request here: its last event goes out at once and the loop is
asked to let the request go (`on_stop`); tokens the engine produced for it
meanwhile are dropped.

    loop thread:    open(req) ... post([OutputItem | StreamError, ...])
    output thread:  text, stop strings -> subscriber queues
    gRPC threads:   Subscribe streams drain their subscriber's queue
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.text.detokenize import Detokenizer
from pdserve.text.sampling_params import SamplingParams
from pdserve.proto import control_pb2 as pb
from pdserve.proto import router_pb2 as rpb

log = logging.getLogger("pdserve.engine")


def _at_interpreter_exit(fn) -> None:
    """Run `fn` as the interpreter begins to exit, before it joins the gRPC
    server's pool threads. A Subscribe stream waits on its queue in such a
    thread: Ray ends a killed actor's worker with a normal exit, and one
    open stream kept the process (and its polling loop thread) alive long
    after its actor was gone. `threading._register_atexit` is the hook
    concurrent.futures itself uses for the same join (CPython 3.9+);
    hooks run newest first, so this one runs before that join."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(fn)


class ErrorKind(enum.Enum):
    """Why a request ended with an error; its router tells its client by
    this, not by the text (values: the wire's control.proto ErrorKind)."""
    ABORTED = pb.ERROR_KIND_ABORTED      # a client or router let it go
    DEADLINE = pb.ERROR_KIND_DEADLINE    # the engine's drain deadline passed
    FAILED = pb.ERROR_KIND_FAILED        # the engine failed it (a round's forward raised)
    INVALID = pb.ERROR_KIND_INVALID      # it cannot be served as asked (its grammar)


@dataclass(frozen=True)
class OpenStream:
    """Loop thread -> output thread: a request's text starts."""
    req_id: str
    subscriber: str
    context: Sequence[int]      # prompt tokens before `prior`: how the first token's text reads
    sp: SamplingParams
    key: object                 # which submission of the id; comes back with a stop string
    prior: Sequence[int]        # a resubmission's tokens that were output already
    chars: int                  # how many characters of their text the client has


@dataclass(frozen=True)
class OutputItem:
    """A round's new tokens of one request."""
    req_id: str
    tokens: Sequence[int]
    logprobs: Sequence = ()     # one Logprob per token, if asked for
    final: str | None = None    # "length" | "stop" (a stop token: no text of its own) | None
    cached_tokens: int = 0      # with `final`: prompt tokens its admission found cached
    # with final "stop": the last token is text that completed the request's
    # grammar (structured outputs), not a stop token
    last_is_text: bool = False


@dataclass(frozen=True)
class StreamError:
    """A request ended with an error; its last event."""
    req_id: str
    error: str                  # for people
    kind: ErrorKind


class _Live:
    __slots__ = ("subscriber", "detok", "min_tokens", "tokens", "key")

    def __init__(self, subscriber, detok, min_tokens, key):
        self.subscriber, self.detok, self.min_tokens, self.tokens, self.key = \
            subscriber, detok, min_tokens, 0, key


def logprob_pb(lp) -> rpb.TokenLogprob:
    return rpb.TokenLogprob(token_id=lp.token, logprob=lp.logprob,
                            top=[rpb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


class Outputs:
    def __init__(self, tokenizer, on_stop, name: str = "engine"):
        self.tok = tokenizer
        self.on_stop = on_stop              # called (output thread) with (request id, key)
        self._in: queue.Queue = queue.Queue()
        self._subs: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}   # output thread only
        self.errors: list[str] = []
        # since when (time.monotonic()) the output thread holds the batch it
        # is on; None while it waits for one: what the watchdog reads
        # (engine/watchdog.py)
        self.busy_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"{name}-outputs", daemon=True)
        self._thread.start()
        _at_interpreter_exit(self.end_streams)

    # ---- the loop thread ------------------------------------------------------
    def open(self, req_id: str, subscriber: str, prompt, sp=None, key=None,
             prior: tuple[int, int] = (0, 0)) -> None:
        """Start a request's text; `sp` (SamplingParams): its stop strings,
        min_tokens and text options. `key` comes back with its stop string
        (`on_stop`): which submission of the id it was found for. `prior`: a
        resubmission's (tokens, chars): the prompt's last tokens are output
        already, and the client has that many characters of their text (the
        rest, held back as a possible stop string or half a character, is
        still to come)."""
        tokens, chars = prior
        cut = len(prompt) - tokens
        self._in.put([OpenStream(req_id, subscriber, prompt[max(cut - 8, 0):cut],
                                 sp or SamplingParams(), key, prompt[cut:], chars)])

    def post(self, items: Sequence[OutputItem | StreamError]) -> None:
        """A round's results, one queue put."""
        if items:
            self._in.put(items)

    # ---- gRPC threads ---------------------------------------------------------
    def subscribe(self, subscriber: str) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        with self._lock:
            old = self._subs.get(subscriber)
            self._subs[subscriber] = q
        if old is not None:
            old.put(None)
        return q

    def unsubscribe(self, subscriber: str, q: queue.Queue) -> bool:
        """Drop the subscription if `q` is still its queue; True if it was."""
        with self._lock:
            if self._subs.get(subscriber) is not q:
                return False
            del self._subs[subscriber]
        return True

    def has(self, subscriber: str) -> bool:
        with self._lock:
            return subscriber in self._subs

    def close(self) -> None:
        self._in.put(None)
        self._thread.join(5)
        self.end_streams()

    def end_streams(self) -> None:
        """Every Subscribe stream ends (its queue gets None)."""
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for q in subs:
            q.put(None)

    # ---- the output thread ------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._in.get()
            if batch is None:
                return
            self.busy_since = time.monotonic()
            try:
                self._batch(batch)
            except Exception as e:          # keep serving the other requests; tests read it
                log.exception("output thread failed on a batch")
                if len(self.errors) < 20:
                    self.errors.append(f"{type(e).__name__}: {e}")
            self.busy_since = None

    def _batch(self, batch: list) -> None:
        out: dict[str, list] = {}
        for item in batch:
            if isinstance(item, OpenStream):
                self._open(item)
                continue
            ev = self._error(item) if isinstance(item, StreamError) else self._event(item)
            if ev is not None:
                out.setdefault(ev[0], []).append(ev[1])
        if not out:
            return
        with self._lock:
            targets = [(self._subs.get(sub), evs) for sub, evs in out.items()]
        for q, evs in targets:
            if q is not None:
                q.put(evs)

    def _open(self, o: OpenStream) -> None:
        sp = o.sp
        detok = Detokenizer(self.tok, o.context, sp.stop, sp.include_stop_str_in_output,
                            sp.skip_special_tokens)
        for t in o.prior:                   # checked for stop strings where they were made
            detok.push(t, check_stop=False)
        detok.skip(o.chars)
        self._live[o.req_id] = _Live(o.subscriber, detok, sp.min_tokens, o.key)

    def _error(self, e: StreamError):
        st = self._live.pop(e.req_id, None)
        if st is None:
            return None                     # ended already (a stop string, an abort)
        return st.subscriber, pb.RequestEvent(request_id=e.req_id, error=e.error,
                                              error_kind=e.kind.value)

    def _event(self, item: OutputItem):
        rid, tokens, logprobs, final = item.req_id, item.tokens, item.logprobs, item.final
        st = self._live.get(rid)
        if st is None:
            return None                     # ended already (a stop string, an abort)
        d = st.detok
        stopped = False
        for i, t in enumerate(tokens):
            st.tokens += 1
            if final == "stop" and i == len(tokens) - 1 and not item.last_is_text:
                break                       # the stop token: no text of its own
            if d.push(t, check_stop=st.tokens >= st.min_tokens):
                stopped = True
                tokens, logprobs = tokens[:i + 1], logprobs[:i + 1]
                break
        if stopped:
            final = "stop"
        ev = pb.RequestEvent(request_id=rid, token_ids=tokens, text=d.ready(final is not None),
                             finish_reason=final or "",
                             logprobs=[logprob_pb(lp) for lp in logprobs],
                             cached_tokens=item.cached_tokens if final else 0)
        if final:
            del self._live[rid]
        if stopped:
            self.on_stop(rid, st.key)
        return st.subscriber, ev
