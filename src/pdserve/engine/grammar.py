"""Structured outputs in the engine: each constrained request's grammar,
compiled off the loop, and its matcher, advanced by every token the request
takes (text/grammar.py is the library's interface).

    register  -> start(): the compile goes to a worker thread; the request
                 waits under Hold.GRAMMAR (the planner sees `grammar_wait`)
    each step -> poll(): compiled grammars become matchers (a resubmitted
                 request's earlier output replayed into it); a compile that
                 failed or ran past engine.grammar_compile_timeout_s
                 fails its request as invalid (the client hears a 400)
    a round   -> fill(): the masks of its sampling rows and verify positions,
                 on the mask thread while the forward runs
    a token   -> accept(): the matcher advances; a complete grammar ends the
                 request (`stop`)

Every token a request takes passes `accept` once, in order, whoever sampled
it: this engine, or P for D's first token (D never samples it again), or a
verify. Retraction and recompute keep the matcher (the tokens stay the
request's); an engine that gets a request again (a resubmission after a
fault) replays its earlier output into a fresh matcher."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from pdserve.text.constraint import Constraint
from pdserve.text.grammar import GrammarCompiler, Matcher, compiler_for, mask_words

log = logging.getLogger("pdserve.engine")

# engine.grammar_compile_timeout_s's default: a compile this long fails its
# request (llguidance's own limits bound one compile far below this; the
# bound is for a schema at those limits on a machine too loaded to run it).
COMPILE_TIMEOUT_S = 30.0


@dataclass
class _Pending:
    future: cf.Future
    started: float


@dataclass
class RoundMasks:
    """A round's masks: `bits[j]` is logit row `rows[j]`'s (text/grammar.py's
    layout); `cpu_s` what filling them cost the mask thread."""
    rows: list[int]
    bits: np.ndarray
    cpu_s: float = 0.0


@dataclass
class GrammarCounts:
    compiled: int = 0
    failed: int = 0
    compile_s: list = field(default_factory=list)     # each compile's seconds (bounded)
    mask_cpu_s: float = 0.0                           # mask thread CPU, all rounds
    masks: int = 0                                    # mask rows filled


class RequestGrammars:
    def __init__(self, tokenizer, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S,
                 clock=time.monotonic):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self.timeout_s, self._clock = timeout_s, clock
        self._compiles: cf.ThreadPoolExecutor | None = None
        self._masks: cf.ThreadPoolExecutor | None = None
        self._pending: dict[str, _Pending] = {}
        self._matchers: dict[str, Matcher] = {}
        self.counts = GrammarCounts()

    # ---- compiles ------------------------------------------------------------------
    def start(self, req_id: str, constraint: Constraint) -> None:
        """Compile `constraint` for `req_id` off the loop."""
        if self._compiles is None:
            self._compiles = cf.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        fut = self._compiles.submit(self._compile, constraint)
        self._pending[req_id] = _Pending(fut, self._clock())

    def _compile(self, constraint: Constraint):
        t = time.perf_counter()
        if self._compiler is None:
            self._compiler = compiler_for(self._tokenizer, self.vocab_size)
        grammar = self._compiler.compile(constraint)
        return grammar.matcher(), time.perf_counter() - t

    def wait_any(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for a compile to finish."""
        cf.wait([p.future for p in self._pending.values()], timeout_s,
                return_when=cf.FIRST_COMPLETED)

    def waiting(self) -> list[str]:
        """Requests whose grammar is still compiling."""
        return list(self._pending)

    def poll(self, replay_of) -> tuple[list[str], list[tuple[str, str]]]:
        """(requests whose matcher is ready now, (request, error) for those
        whose compile failed or ran out of time). `replay_of(id)`: the tokens
        the request output before it came here (a resubmission's), fed to
        its fresh matcher first."""
        ready, failed = [], []
        now = self._clock()
        for rid, p in list(self._pending.items()):
            if p.future.done():
                del self._pending[rid]
                try:
                    matcher, seconds = p.future.result()
                except Exception as e:              # GrammarError, or the library's own
                    self.counts.failed += 1
                    failed.append((rid, f"its structured output could not be compiled: {e}"))
                    continue
                if not all(matcher.accept(t) for t in replay_of(rid)):
                    self.counts.failed += 1
                    failed.append((rid, "its earlier output does not match its structured "
                                        "output's grammar"))
                    continue
                self.counts.compiled += 1
                if len(self.counts.compile_s) < 100_000:
                    self.counts.compile_s.append(seconds)
                self._matchers[rid] = matcher
                ready.append(rid)
            elif now - p.started > self.timeout_s:
                del self._pending[rid]
                self.counts.failed += 1
                failed.append((rid, f"compiling its structured output's grammar took longer "
                                    f"than {self.timeout_s:g} s (engine.grammar_compile_"
                                    "timeout_s); simplify the schema"))
        return ready, failed

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._matchers.pop(req_id, None)

    # ---- tokens ----------------------------------------------------------------------
    def constrained(self, req_id: str) -> bool:
        return req_id in self._matchers

    def accept(self, req_id: str, token: int) -> bool:
        """Advance `req_id`'s matcher by `token`: True when the grammar is
        complete after it (the request ends). A token the grammar does not
        allow (only a peer's could be) ends the request too, logged."""
        m = self._matchers.get(req_id)
        if m is None:
            return False
        if not m.accept(token):
            log.warning("request %s: token %d is not allowed by its grammar; it ends here",
                        req_id, token)
            return True
        return m.is_done()

    def valid_drafts(self, req_id: str, drafts: list[int]) -> list[int]:
        """The leading candidates the grammar allows (speculation)."""
        m = self._matchers.get(req_id)
        if m is None or not drafts:
            return drafts
        return drafts[:m.valid_prefix(drafts)]

    # ---- a round's masks ------------------------------------------------------------------
    def submit_fill(self, rows: list, verifies: list, n: int) -> cf.Future | None:
        """Start filling the masks of a round on the mask thread (None: no
        row is constrained): `rows` the requests sampling one token (logit
        rows 0..n-1), `verifies` (request, candidates) whose 1 + len rows
        follow, in order."""
        # a complete grammar's request ended: a round that ran ahead may still
        # sample it, and that token is dropped; its mask would allow nothing
        sample = [(i, m) for i, r in enumerate(rows)
                  if (m := self._matchers.get(r.id)) is not None and not m.is_done()]
        spec, at = [], n
        for req, drafts in verifies:
            m = self._matchers.get(req.id)
            if m is not None and not m.is_done():
                spec.append((at, m, list(drafts)))
            at += 1 + len(drafts)
        if not sample and not spec:
            return None
        if self._masks is None:
            self._masks = cf.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._masks.submit(self._fill, sample, spec)

    def _fill(self, sample, spec) -> RoundMasks:
        c0 = time.thread_time()
        count = len(sample) + sum(1 + len(d) for _, _, d in spec)
        bits = np.full((count, mask_words(self.vocab_size)), -1, dtype=np.int32)
        rows: list[int] = []
        for j, (row, m) in enumerate(sample):
            m.fill_mask(bits, j)
            rows.append(row)
        j = len(sample)
        for at, m, drafts in spec:
            # a mask per verified position: the state after each candidate,
            # then back; positions past an invalid candidate are never reached
            # (the mask before it forbids it, so the verify rejects it)
            ok = m.valid_prefix(drafts)     # checked first: a refused accept is final
            for pos in range(ok + 1):
                m.fill_mask(bits, j + pos)
                rows.append(at + pos)
                if pos < ok:
                    m.accept(drafts[pos])
            rows += range(at + ok + 1, at + 1 + len(drafts))    # left all allowed
            m.rollback(ok)
            j += 1 + len(drafts)
        cpu = time.thread_time() - c0
        self.counts.mask_cpu_s += cpu
        self.counts.masks += count
        return RoundMasks(rows, bits, cpu)

    def close(self) -> None:
        for pool in (self._compiles, self._masks):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def grammar_holds(planner, executor, idle_wait_s: float = 0.005) -> tuple[list, str]:
    """Before a build: requests whose grammar still compiles wait
    (`Request.grammar_wait`, Hold.GRAMMAR); ready ones are admitted from
    this round on. Returns the requests aborted because their compile failed
    or ran out of time (to be failed with their router told) and why.
    `idle_wait_s`: how long to wait for a compile when nothing else runs
    here (a loop with nothing to do would otherwise spin)."""
    g = getattr(executor, "grammars", None)
    if g is None or not g.waiting():
        return [], ""
    p = planner
    for rid in g.waiting():
        req = p.requests.get(rid)
        if req is not None:
            req.grammar_wait = True
    if idle_wait_s and not (p.running or p.prefilling):
        g.wait_any(idle_wait_s)

    def replay_of(rid: str) -> list[int]:
        req, prior = p.requests.get(rid), executor.prior_output(rid)
        return req.prompt.tokens[len(req.prompt.tokens) - prior:] if req and prior else []

    ready, failed = g.poll(replay_of)
    for rid in ready:
        req = p.requests.get(rid)
        if req is not None:
            req.grammar_wait = False
    gone = [p.abort(rid, why) for rid, why in failed if rid in p.requests]
    return gone, failed[0][1] if failed else ""

