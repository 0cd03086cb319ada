"""The P/D autoscaler's policy: from what the router saw since the last
look, one action or none. Pure: no clock, no I/O (the actor in
autoscaler.py observes, acts and keeps time).

Signals, each read per role because P and D fail differently:
  prefill is short  TTFT p95 over its target, or requests queued for a
                    prefill (waiting on P, or on D for a prefill peer);
  decode is short   ITL p95 over its target, D's pages nearly full, or
                    requests waiting on D for pages.
TTFT counts queue wait (arrival to first token), so a backlog shows before
the first token is late, unlike a planner that reads only the time a
prefill takes (Dynamo's issue #10528). One step at a time: nothing while an
engine is starting or draining, nothing within the cooldown of the last
action's end. A role under its minimum (its last engine drained by hand)
gets an engine back first: with none, no request reaches it to breach.
An engine comes off only when every signal has been calm for
`scale_down_after_s` and the survivors would carry its load: what it holds
spread over them stays under `low_water` of their pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config import AutoscaleConfig, RoleBounds  # noqa: F401 (the policy's settings)

# waiting reasons (scheduler/round/waiting.py) that mean "short of prefill" or
# "short of decode pages"
PREFILL_WAITS = {"waiting_for_prefill", "behind_incomplete_prefill", "budget"}
DECODE_WAITS = {"capacity", "remote_admission_limit", "readmission_seal"}


@dataclass
class EngineView:
    name: str
    role: str
    running: int = 0
    used_pages: int = 0
    total_pages: int = 1
    waiting: dict = field(default_factory=dict)   # reason -> requests
    known: bool = True               # its stats came in this look (else: load unknown)
    alive: bool = True               # answering the router's membership checks


@dataclass
class Observation:
    """What the router saw over the last interval."""
    now: float
    engines: list                    # EngineView, live and serving (not draining)
    ttft_p95: float | None = None    # None: no first token in the interval
    itl_p95: float | None = None
    arrivals_per_s: float = 0.0
    pending: bool = False            # an engine is starting or draining


@dataclass(frozen=True)
class Action:
    kind: str                        # "add" | "drain"
    role: str
    engine: str = ""                 # drain: which one
    why: str = ""


@dataclass
class PolicyState:
    last_action_at: float = float("-inf")
    calm_since: float | None = None


def decide(cfg: AutoscaleConfig, obs: Observation, state: PolicyState) -> Action | None:
    """One action or none; updates `state` (the calm clock, the cooldown)."""
    by_role = {r: [e for e in obs.engines if e.role == r] for r in ("prefill", "decode")}
    short = _shortages(cfg, obs, by_role)
    if short:
        state.calm_since = None
    elif state.calm_since is None:
        state.calm_since = obs.now
    if obs.pending:
        # the cooldown runs from when the action is done: a backlog that built
        # up while an engine started is not a second breach
        state.last_action_at = obs.now
        return None
    if obs.now - state.last_action_at < cfg.cooldown_s:
        return None
    for role in ("prefill", "decode"):            # below the floor (drained by hand, lost)
        if len(by_role[role]) < cfg.bounds(role).min:
            state.last_action_at = obs.now
            return Action("add", role, why=f"{len(by_role[role])} {role} engines, under "
                                           f"the minimum of {cfg.bounds(role).min}")
    for role, why in short:                       # worst breach first
        if len(by_role[role]) < cfg.bounds(role).max:
            state.last_action_at = obs.now
            return Action("add", role, why=why)
    if short or state.calm_since is None or obs.now - state.calm_since < cfg.scale_down_after_s:
        return None
    for role in ("decode", "prefill"):
        engines = by_role[role]
        if len(engines) <= cfg.bounds(role).min or not all(e.known and e.alive for e in engines):
            continue                              # at the floor, or a load it cannot read
        victim = min(engines, key=lambda e: (e.running, e.used_pages, e.name))
        rest = [e for e in engines if e is not victim]
        used = sum(e.used_pages for e in engines)
        pool = sum(e.total_pages for e in rest)
        if used <= cfg.low_water * pool:
            state.last_action_at = obs.now
            return Action("drain", role, victim.name,
                          f"calm for {obs.now - state.calm_since:.0f} s; {used} pages fit "
                          f"the other {len(rest)} {role} engines ({pool} pages)")
    return None


def _shortages(cfg, obs, by_role) -> list[tuple[str, str]]:
    """(role, why) for each role short of engines, the worst breach first."""
    out = []
    p_queue = sum(n for e in obs.engines for r, n in e.waiting.items()
                  if r in PREFILL_WAITS or (r == "capacity" and e.role == "prefill"))
    d_queue = sum(n for e in by_role["decode"] for r, n in e.waiting.items()
                  if r in DECODE_WAITS)
    if obs.ttft_p95 is not None and obs.ttft_p95 > cfg.ttft_s:
        out.append((obs.ttft_p95 / cfg.ttft_s, "prefill",
                    f"TTFT p95 {obs.ttft_p95:.2f} s over the {cfg.ttft_s} s target"))
    elif p_queue >= cfg.queue_high:
        out.append((p_queue / cfg.queue_high, "prefill", f"{p_queue} requests wait for a prefill"))
    decode = by_role["decode"]
    usage = sum(e.used_pages for e in decode) / max(sum(e.total_pages for e in decode), 1)
    if obs.itl_p95 is not None and obs.itl_p95 > cfg.itl_s:
        out.append((obs.itl_p95 / cfg.itl_s, "decode",
                    f"ITL p95 {obs.itl_p95 * 1000:.0f} ms over the {cfg.itl_s * 1000:.0f} ms "
                    "target"))
    elif decode and usage > cfg.kv_high:
        out.append((usage / cfg.kv_high, "decode",
                    f"decode pages {usage:.0%} used, over {cfg.kv_high:.0%}"))
    elif d_queue >= cfg.queue_high:
        out.append((d_queue / cfg.queue_high, "decode", f"{d_queue} requests wait for D's pages"))
    out.sort(key=lambda t: -t[0])
    return [(role, why) for _, role, why in out]
