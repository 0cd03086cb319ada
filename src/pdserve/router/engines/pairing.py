"""Which engines serve a request: a fused engine, or a D engine and a P
engine. Least outstanding tokens on each side, except that the engine that
last served the same first page wins while it is not much busier, so its
prefix cache is reused. Pure bookkeeping: no RPC, no clock."""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

    from pdserve.proto import control_pb2_grpc as cpbg

ROUTES = ("", "fused", "disaggregated")
ROUTE_ROLES = {"fused": {"fused"}, "disaggregated": {"prefill", "decode"}}   # what a route needs
AFFINITY_SLACK_TOKENS = 4096   # how much more load a warm prefix cache is worth
AFFINITY_ENTRIES = 65536       # first pages remembered (LRU)


@dataclasses.dataclass
class EngineRef:
    name: str
    role: str
    address: str
    # both made on the router's loop (membership.connect), before any call
    stub: cpbg.EngineControlStub | None = None    # the EngineControl stub
    channel: grpc.aio.Channel | None = None       # the channel the stub is on
    incarnation: int = 0
    alive: bool = True
    draining: bool = False        # told to drain: takes no new request, never picked
    joining: bool = False         # added, not yet subscribed and introduced: never picked

    @property
    def serving(self) -> bool:
        """A candidate for new requests: alive, healthy, not draining or
        joining, and holding no request moved elsewhere that it has yet
        to abort (a pick could send the same id back)."""
        return (self.alive and not self.draining and not self.joining and not self.unhealthy
                and not self.orphans)
    load: int = 0                 # outstanding tokens the router sent it
    # the LoRA adapter loads it holds (ids): the configured ones, and those a
    # runtime load confirmed on it (router/lora/admin.py)
    adapters: set = dataclasses.field(default_factory=set)
    misses: int = 0               # membership rounds in a row it did not answer
    removed: int = 0              # the incarnation its peers were told is gone (membership)
    kv_capacity_tokens: int = 0   # what its GetInfo said its KV pools hold
    # liveness, kept by its link's probe (link.py): why it is not healthy now
    # ("": it is), when it last answered healthy (loop time), its watchdog's
    # readings then, and the requests moved off it while it still held them
    # (aborted there by the link, which then forgets them)
    unhealthy: str = ""
    healthy_at: float = 0.0
    loop_quiet_s: float = 0.0
    outputs_busy_s: float = 0.0
    orphans: set = dataclasses.field(default_factory=set)

    @property
    def control(self) -> cpbg.EngineControlStub:
        """The stub to call the engine on; membership.connect made it before
        the router's first call."""
        assert self.stub is not None, f"engine {self.name} has no channel yet"
        return self.stub


class Pairing:
    def __init__(self, engines: dict[str, EngineRef], page_size: int):
        self.engines = engines
        self.page_size = page_size
        self._affinity: collections.OrderedDict = collections.OrderedDict()

    def _choose(self, cands: list, prefix) -> EngineRef:
        """Least outstanding tokens, unless the engine that last served this
        prompt's first page (its prefix cache is warm) is within
        AFFINITY_SLACK_TOKENS of the least loaded."""
        best = min(cands, key=lambda e: (e.load, e.name))
        warm = self._affinity.get((prefix, best.role))
        for e in cands:
            if e.name == warm and e.load <= best.load + AFFINITY_SLACK_TOKENS:
                best = e
        self._affinity[(prefix, best.role)] = best.name
        self._affinity.move_to_end((prefix, best.role))
        if len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        return best

    def candidates(self, route: str) -> tuple[list, list]:
        """(engines that could decode the request, prefill engines for a D).
        A draining engine is never a candidate. With no serving P (all
        down, silent or cut off by a partition) a D still takes requests
        and prefills them itself, slower but not refused, as the simulator
        has it (sim/simulation.py's arrivals)."""
        live = [e for e in self.engines.values() if e.serving]
        fused = [e for e in live if e.role == "fused"]
        dec = [e for e in live if e.role == "decode"]
        pre = [e for e in live if e.role == "prefill"]
        cands = fused if route == "fused" else dec if route == "disaggregated" else fused + dec
        if not cands:
            shown = repr(route) if route else "any ('')"
            raise LookupError(f"no live engine can serve route {shown}: {self._why_none()}")
        return cands, pre

    def _why_none(self) -> str:
        """What each engine is doing instead of serving, for the refusal."""
        def state(e):
            if e.draining or not e.alive or e.joining:
                return "is draining" if e.draining else "is down" if not e.alive else \
                    "is starting"
            if e.unhealthy:
                return f"is unhealthy ({e.unhealthy})"
            return f"is aborting {len(e.orphans)} requests moved off it"
        states = [f"{e.name} {state(e)}"
                  for e in sorted(self.engines.values(), key=lambda e: e.name) if not e.serving]
        return "; ".join(states) or "this deployment has no engine of the roles it needs"

    @staticmethod
    def _holding(engines: list, adapter: int) -> list:
        """The engines that hold adapter load `adapter`: a P must compute the
        prompt under the adapter its D decodes with."""
        return [e for e in engines if adapter in e.adapters]

    def pick(self, route: str, ids=(), adapter: int = 0) -> tuple[EngineRef, EngineRef | None]:
        """`adapter`: the request's LoRA load id; a prefix is warm only
        where the same adapter computed it."""
        cands, pre = self.candidates(route)
        if adapter:
            holding = self._holding(pre, adapter)
            cands = self._holding(cands, adapter)
            if pre and not holding:       # Ps serve but lack it (not loaded there yet): a D
                cands = [e for e in cands if e.role != "decode"]   # would prefill all itself
            pre = holding
            if not cands:
                raise LookupError(f"no live engine of route {route!r} holds LoRA adapter load "
                                  f"{adapter}; load it there (POST /v1/load_lora_adapter)")
        prefix = (adapter, tuple(ids[:self.page_size]))
        target = self._choose(cands, prefix)
        peer = self._choose(pre, prefix) if target.role == "decode" and pre else None
        return target, peer
