"""Prometheus metrics at the router's /metrics, named like vLLM's where the
meaning is the same, with the prefix `pdserve:` and an `engine` label.

Two sources: what the router sees of each request (latencies, token counts,
finish reasons), observed as streams run; and what each engine counts
(requests, pages, prefix cache, transfers, leases, fences, retractions),
read from the engines' Stats at scrape time. Each router has a registry of
its own, so two routers in one process never share a series.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

P = "pdserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0)


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token",
                              ["engine"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds",
                             "Time between successive streamed tokens", ["engine"],
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token",
                             ["engine"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests",
                                     ["engine"], registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated",
                                         ["engine"], registry=r)
        self.success = Counter(P + "request_success", "Finished requests by reason",
                               ["engine", "finished_reason"], registry=r)
        self.rejected = Counter(P + "request_errors", "Requests refused or failed, by kind",
                                ["reason"], registry=r)
        self.arrivals = Counter(P + "requests_arrived", "Requests admitted, counted at arrival",
                                registry=r)
        self.resubmitted = Counter(P + "requests_resubmitted",
                                   "Requests moved to another engine after theirs died",
                                   registry=r)
        self.stalled = Counter(P + "requests_stalled", "Requests moved off an engine that was "
                               "unhealthy or silent and sent them nothing for "
                               "router.engine_silent_s (each also counts as resubmitted)",
                               ["engine"], registry=r)
        self._engines = _EngineCollector()
        r.register(self._engines)
        self._series: dict[str, tuple] = {}

    def per_engine(self, engine: str) -> tuple:
        """(ttft, itl, generation_tokens) of one engine: looked up once, not
        per token (`labels` takes a lock and builds a key each call)."""
        s = self._series.get(engine)
        if s is None:
            s = self._series[engine] = (self.ttft.labels(engine), self.itl.labels(engine),
                                        self.generation_tokens.labels(engine))
        return s

    def load(self):
        """What the autoscaler reads: arrivals, and TTFT and ITL as cumulative
        bucket counts summed over engines (router_pb2.RouterLoad)."""
        from pdserve.proto import router_pb2 as pb

        out = pb.RouterLoad(arrivals=int(self.arrivals._value.get()))
        for hist, bounds, counts in ((self.ttft, out.ttft_bounds, out.ttft_counts),
                                     (self.itl, out.itl_bounds, out.itl_counts)):
            by_le: dict[float, float] = {}
            for metric in hist.collect():
                for s in metric.samples:
                    if s.name.endswith("_bucket"):
                        le = float(s.labels["le"])
                        by_le[le] = by_le.get(le, 0.0) + s.value
            les = sorted(by_le) or [float("inf")]
            bounds.extend(le for le in les if le != float("inf"))
            counts.extend(int(by_le.get(le, 0)) for le in les)
        return out

    def request(self, prompt_tokens: int, arrived: float) -> "RequestTiming":
        return RequestTiming(self, prompt_tokens, arrived)

    def render(self, engine_stats, engines=()) -> bytes:
        """The exposition text, engines' series from `engine_stats`:
        [(EngineRef, EngineStatsResponse)] fetched just now; and from
        `engines` (EngineRefs), their liveness as the router sees it."""
        self._engines.snapshot, self._engines.refs = engine_stats, list(engines)
        try:
            return generate_latest(self.registry)
        finally:
            self._engines.snapshot, self._engines.refs = [], []


class RequestTiming:
    __slots__ = ("m", "prompt_tokens", "arrived", "last")

    def __init__(self, m: RouterMetrics, prompt_tokens: int, arrived: float):
        self.m, self.prompt_tokens, self.arrived = m, prompt_tokens, arrived
        self.last: float | None = None      # when the last tokens came; None: none yet

    def tokens(self, engine: str, n: int) -> None:
        if not n:
            return
        now = time.perf_counter()
        ttft, itl, generated = self.m.per_engine(engine)
        if self.last is None:
            ttft.observe(now - self.arrived)
        else:
            itl.observe((now - self.last) / n)
        self.last = now
        generated.inc(n)

    def finished(self, engine: str, reason: str) -> None:
        self.m.e2e.labels(engine).observe(time.perf_counter() - self.arrived)
        self.m.prompt_tokens.labels(engine).inc(self.prompt_tokens)
        self.m.success.labels(engine, reason).inc()


_GAUGES = (
    ("num_requests_running", "Requests admitted on the engine (P: until D's ack)", "running"),
    ("num_requests_waiting", "Requests waiting for admission or readmission", "waiting"),
    ("kv_pages_used", "KV pages held by requests, pins or fences", "used_pages"),
    ("kv_pages_pinned", "KV pages held for a peer (P until the ack, D landing)",
     "pinned_pages"),
    ("kv_pages_total", "KV pages in the engine's device pool", "total_pages"),
    ("kv_pages_quarantined", "D's landing pages a write given up on may still reach, held "
     "until its P says the write ended (counted in kv_pages_pinned too)", "quarantined_pages"),
    ("kv_capacity_tokens", "Tokens of history the KV pools hold, sliding windows counted as "
     "windows", "kv_capacity_tokens"),
)
_COUNTERS = (
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", "prefix_hits"),
    ("kv_transfers", "KV transfers (P: posted, D: landed)", "transfers"),
    ("kv_transfer_bytes", "KV bytes written to decode engines", "transfer_bytes"),
    ("lease_expiries", "P pins released because D's lease ran out", "lease_expiries"),
    ("fences", "Landing pages fenced against a late write", "fences"),
    ("stale_jobs", "Jobs for the engine's loop dropped unrun: their callers had given up",
     "stale_jobs"),
    ("stale_peer_messages", "Peer messages from an engine incarnation older than the one "
     "known, ignored", "stale_messages"),
    ("retractions", "Requests retracted for capacity", "retractions"),
    ("readmissions", "Retracted requests readmitted", "readmissions"),
    ("liveness_stalls", "Rounds the liveness last resort ran", "stalls"),
    ("requests_aborted", "Requests aborted on the engine (client or peer)", "aborted"),
    ("requests_finished", "Requests finished on the engine", "finished"),
    ("engine_rounds", "Rounds the engine ran", "rounds"),
    ("engine_round_seconds", "Wall time of the engine's rounds (its rate: the share of time "
     "the engine computes)", "round_seconds"),
    ("engine_round_cpu_seconds", "CPU time of the engine's loop thread in its rounds (below "
     "round_seconds: it waited for a core or for the GIL)", "round_cpu_seconds"),
    ("engine_round_tokens", "Tokens the engine's rounds computed, prefill and decode (over "
     "rounds: the mean batch)", "round_tokens"),
)


class _EngineCollector:
    def __init__(self):
        self.snapshot = []
        self.refs = []

    def describe(self):
        return []                          # scraped on demand: nothing to check at register

    def collect(self):
        fams = {}
        for name, doc, _ in _GAUGES:
            fams[name] = GaugeMetricFamily(P + name, doc, labels=["engine", "role"])
        usage = GaugeMetricFamily(P + "kv_cache_usage_perc", "Share of KV pages in use (0-1)",
                                  labels=["engine", "role"])
        for name, doc, _ in _COUNTERS:
            fams[name] = CounterMetricFamily(P + name, doc, labels=["engine", "role"])
        failures = CounterMetricFamily(P + "kv_transfer_failures", "KV transfers that failed, "
                                       "by stage", labels=["engine", "role", "stage"])
        seconds = HistogramMetricFamily(P + "kv_transfer_seconds", "KV write post to "
                                        "completion, on P", labels=["engine", "role"])
        group_labels = ["engine", "role", "group"]
        group_used = GaugeMetricFamily(P + "kv_group_pages_used", "KV pages held in each cache "
                                       "group (full_history, sliding_window_W)",
                                       labels=group_labels)
        group_total = GaugeMetricFamily(P + "kv_group_pages_total", "KV pages in each cache "
                                        "group's pool", labels=group_labels)
        by_tier = CounterMetricFamily(P + "prompt_tokens_cached", "Prompt tokens admitted "
                                      "cached, by the tier that held them (device, host, disk)",
                                      labels=["engine", "role", "tier"])
        disk = CounterMetricFamily(P + "disk_cache", "The disk tier's counters: probes, "
                                   "prefetch outcomes, reads hit and missed, bytes read and "
                                   "written (engine/disk/tier.py)",
                                   labels=["engine", "role", "counter"])
        lora = GaugeMetricFamily(P + "lora_requests_info", "Each engine's LoRA adapters in "
                                 "use, as labels (vLLM's metric): those of running and of "
                                 "waiting requests, comma-separated, and its device slots",
                                 labels=["engine", "role", "running_lora_adapters",
                                         "waiting_lora_adapters", "max_lora"])
        spec = SpecMetrics()
        for ref, s in self.snapshot:
            labels = [ref.name, s.role]
            if s.max_loras:
                lora.add_metric(labels + [",".join(s.lora_running), ",".join(s.lora_waiting),
                                          str(s.max_loras)], 1)
            spec.add(labels, s)
            for name, _, field in _GAUGES + _COUNTERS:
                fams[name].add_metric(labels, getattr(s, field))
            usage.add_metric(labels, s.used_pages / s.total_pages if s.total_pages else 0.0)
            for g in s.cache_groups:
                name = g.retention + (f"_{g.window}" if g.window else "")
                group_used.add_metric(labels + [name], g.used_pages)
                group_total.add_metric(labels + [name], g.total_pages)
            for stage, n in sorted(s.transfer_failures_by_stage.items()):
                failures.add_metric(labels + [stage], n)
            for tier, n in sorted(s.cached_tokens_by_tier.items()):
                by_tier.add_metric(labels + [tier], n)
            for counter, n in sorted(s.disk_cache.items()):
                disk.add_metric(labels + [counter], n)
            if s.role == "prefill" and s.transfer_seconds_buckets:
                bounds = [str(b) for b in s.transfer_seconds_buckets] + ["+Inf"]
                seconds.add_metric(labels, list(zip(bounds, s.transfer_seconds_counts)),
                                   s.transfer_seconds_sum)
        yield from fams.values()
        yield usage
        yield failures
        yield seconds
        yield group_used
        yield group_total
        yield by_tier
        yield disk
        yield lora
        yield from spec.families()
        yield from _liveness(self.refs)


def _liveness(refs):
    """Each engine's health as its link last saw it (router/engines/link.py)."""
    labels = ["engine", "role"]
    healthy = GaugeMetricFamily(P + "engine_healthy", "1 while the engine answers healthy "
                                "(its loop and output thread progress), else 0: the router "
                                "moves its requests and picks it no more", labels=labels)
    quiet = GaugeMetricFamily(P + "engine_loop_quiet_seconds", "Since the engine's loop "
                              "thread last ended a pass, at its last answer", labels=labels)
    busy = GaugeMetricFamily(P + "engine_outputs_busy_seconds", "How long the engine's output "
                             "thread had been on one batch at its last answer (0: idle)",
                             labels=labels)
    for ref in refs:
        labels = [ref.name, ref.role]
        healthy.add_metric(labels, 0.0 if ref.unhealthy else 1.0)
        quiet.add_metric(labels, ref.loop_quiet_s)
        busy.add_metric(labels, ref.outputs_busy_s)
    yield healthy
    yield quiet
    yield busy


class SpecMetrics:
    """Speculative decoding's metrics, by vLLM's names where the meaning is
    the same (vllm:spec_decode_*): drafts (verifies run), draft tokens (the
    candidates they carried), accepted tokens, accepted tokens per
    candidate position; and the gate (engine/spec/gate.py): 1 while the
    engine proposes, and the tokens/s it measured with and without."""

    def __init__(self) -> None:
        labels = ["engine", "role"]
        self.counters = {
            key: CounterMetricFamily(P + f"spec_decode_{key}", doc, labels=labels)
            for key, doc in (("num_drafts", "Speculative verifies run"),
                             ("num_draft_tokens", "Candidate tokens the verifies carried"),
                             ("num_accepted_tokens", "Candidate tokens accepted"))}
        self.per_pos = CounterMetricFamily(
            P + "spec_decode_num_accepted_tokens_per_pos", "Candidate tokens accepted at each "
            "position of the verify (0: the first candidate)", labels=labels + ["position"])
        self.gate = GaugeMetricFamily(P + "spec_decode_gate_on", "1 while the speculation "
                                      "gate proposes candidates (probing included), else 0",
                                      labels=labels + ["mode"])
        self.rates = GaugeMetricFamily(P + "spec_decode_gate_tokens_per_second", "Delivered "
                                       "tokens per second of the engine process's CPU time "
                                       "the gate measured at the batch it last ran, with "
                                       "speculation (on) and without (off)",
                                       labels=labels + ["side"])

    def add(self, labels: list, s) -> None:
        if not s.spec_gate:
            return                          # the engine does not speculate
        for key, fam in self.counters.items():
            fam.add_metric(labels, s.spec_decode.get(key, 0))
        for pos, n in enumerate(s.spec_accepted_per_pos):
            self.per_pos.add_metric(labels + [str(pos)], n)
        self.gate.add_metric(labels + [s.spec_gate],
                             1.0 if s.spec_gate in ("on", "probe_on", "ungated") else 0.0)
        self.rates.add_metric(labels + ["on"], s.spec_tokens_per_s_on)
        self.rates.add_metric(labels + ["off"], s.spec_tokens_per_s_off)

    def families(self):
        yield from self.counters.values()
        yield self.per_pos
        yield self.gate
        yield self.rates
