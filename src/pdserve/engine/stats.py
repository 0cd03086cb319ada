"""What an engine counts for operators: request and transfer counters, a
transfer-time histogram, prefix-cache queries and hits, and its rounds
(how many, their wall and loop-thread CPU time, their tokens); and the Stats
RPC's answer built from them and the planner (`stats_pb`). Plain numbers,
turned into Prometheus metrics by the router (router/metrics.py)."""

from __future__ import annotations

import bisect

from pdserve.proto import control_pb2 as cpb
from pdserve.proto import router_pb2 as pb
from pdserve.scheduler.round.grammar import Role

# seconds: a local NIXL write takes about a millisecond, a cross-node one of a
# long prompt up to seconds
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)


class Histogram:
    def __init__(self, bounds=TRANSFER_BUCKETS):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)     # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


class EngineCounters:
    """Monotonic counts since the engine started (a restart starts over, as
    Prometheus counters may)."""

    NAMES = ("finished", "aborted", "retractions", "readmissions", "transfers",
             "transfer_failures", "transfer_bytes", "lease_expiries", "fences",
             "prefix_queries", "prefix_hits", "rounds", "round_seconds", "round_cpu_seconds",
             "round_tokens", "stale_jobs", "stale_messages")

    def __init__(self) -> None:
        # declared one by one so that the checker knows them; NAMES is what
        # as_dict (the Stats message's fields) reads
        self.finished = 0
        self.aborted = 0
        self.retractions = 0
        self.readmissions = 0
        self.transfers = 0
        self.transfer_failures = 0
        self.transfer_bytes = 0
        self.lease_expiries = 0
        self.fences = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.rounds = 0
        self.round_seconds: float = 0
        self.round_cpu_seconds: float = 0
        self.round_tokens = 0
        self.stale_jobs = 0             # loop jobs dropped unrun: their callers had given up
        self.stale_messages = 0         # peer messages from an incarnation older than known
        self.failures_by_stage: dict[str, int] = {}
        self.transfer_seconds = Histogram()
        self._prefix_seen: set[str] = set()

    def round_done(self, seconds: float, cpu_seconds: float, tokens: int) -> None:
        """A round took `seconds` of wall time, `cpu_seconds` of the loop
        thread's CPU (the rest it waited: for a core, or for the GIL that the
        engine's other threads hold) and computed `tokens`."""
        self.rounds += 1
        self.round_seconds += seconds
        self.round_cpu_seconds += cpu_seconds
        self.round_tokens += tokens

    def job_dropped(self) -> None:
        self.stale_jobs += 1

    def transfer_failed(self, stage: str) -> None:
        self.transfer_failures += 1
        self.failures_by_stage[stage] = self.failures_by_stage.get(stage, 0) + 1

    def prefix_lookup(self, req_id: str, prompt_tokens: int, hit_tokens: int) -> None:
        """Count a request's prompt once, at its first admission."""
        if req_id in self._prefix_seen:
            return
        self._prefix_seen.add(req_id)
        self.prefix_queries += prompt_tokens
        self.prefix_hits += hit_tokens

    def forget(self, req_id: str) -> None:
        self._prefix_seen.discard(req_id)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.NAMES}


def waiting_requests_pb(planner) -> list:
    """Each request that is not running, with the rule that held it in the
    planner's last round (scheduler/round/waiting.py), as the Stats message has it."""
    return [pb.WaitingRequest(request_id=w.req_id, reason=str(w.reason), detail=w.detail,
                              pages_needed=w.pages_needed or 0, pages_free=w.pages_free or 0)
            for w in planner.waiting_reasons()]


def stats_pb(planner, role: Role, counts: EngineCounters, capacity: dict, dtype: str,
             attention: str, disk: dict | None = None,
             lora: tuple[list[str], list[str]] = ([], []), spec=None,
             quarantined: tuple = (), experts: list | None = None) -> cpb.EngineStatsResponse:
    """The Stats RPC's answer: pages used and pinned, requests running and
    waiting (and why), the counters, each cache group's use, `lora`: the
    adapters of running and of waiting requests (engine/lora/adapters.py),
    `spec`: the executor's Speculation (engine/spec/speculation.py), if it
    speculates, and `quarantined`: the fence keys of D's quarantined
    landings (engine/peer/protocol.py), whose pages are counted as pinned
    and as quarantined; `experts`: a MoE model's `expert_tokens`."""
    p = planner
    total = p.total_pages
    used = total - p.free_pages()
    if role is Role.PREFILL:
        pinned = used
    else:
        pinned = sum(len(r.state.res.tables[0]) for r in p.landing.values()) + \
            p.held_by_fences()
    hist = counts.transfer_seconds
    coord = p.coord
    held = [coord.fences.get(key) for key in quarantined]
    quarantined_pages = sum(len(f[0]) for f in held if f)
    groups = [pb.CacheGroupUsage(retention=e["retention"], window=e["window"],
                                 layers=e["layers"], total_pages=e["pages"],
                                 used_pages=e["pages"] - coord.available_pages(g),
                                 page_bytes=e["page_bytes"])
              for g, e in enumerate(capacity["groups"])]
    return cpb.EngineStatsResponse(
        total_pages=total, used_pages=used, pinned_pages=pinned,
        running=len(p.prefilling) + len(p.running) + len(p.landing) + len(p.transferring),
        waiting=len(p.waiting) + len(p.retracted), role=role.value,
        stalls=len(p.stalls), transfer_failures_by_stage=counts.failures_by_stage,
        transfer_seconds_buckets=hist.bounds, transfer_seconds_counts=hist.cumulative(),
        transfer_seconds_sum=hist.sum, waiting_requests=waiting_requests_pb(p),
        dtype=dtype, attention=attention, kv_capacity_tokens=capacity["tokens"],
        cache_groups=groups, cached_tokens_by_tier={
            "device": p.hits.device_tokens, "host": p.hits.host_tokens,
            "disk": p.hits.disk_tokens}, disk_cache=disk or {},
        lora_running=lora[0], lora_waiting=lora[1], max_loras=p.lora.slots,
        quarantined_pages=quarantined_pages, expert_tokens=experts or [],
        **spec_fields(spec), **counts.as_dict())


def expert_tokens(model) -> list:
    """Per sparse layer of a MoE model, the tokens routed to each expert
    (kernels/models/moe/experts.py's counts; a tensor-parallel engine's rank
    0 routes every token as every rank does); [] for a dense model."""
    inner = getattr(model, "model", model)      # a TpLeader: rank 0's shard
    moe = getattr(getattr(inner, "cfg", None), "moe", None)    # a test's fake has no cfg
    if moe is None:
        return []
    return [cpb.ExpertTokens(layer=layer, tokens=e.counts.tolist())
            for layer, e in zip(moe.sparse_layers, inner.expert_layers())]


def spec_fields(spec) -> dict:
    """The Stats message's speculation fields (none without speculation)."""
    if spec is None:
        return {}
    c = spec.counts
    on, off = spec.gate.rates() if spec.gate is not None else (0.0, 0.0)
    return {"spec_decode": {"num_drafts": c.drafts, "num_draft_tokens": c.draft_tokens,
                            "num_accepted_tokens": c.accepted_tokens},
            "spec_accepted_per_pos": c.accepted_per_pos,
            "spec_gate": spec.gate.mode.value if spec.gate is not None else "ungated",
            "spec_tokens_per_s_on": on, "spec_tokens_per_s_off": off}
