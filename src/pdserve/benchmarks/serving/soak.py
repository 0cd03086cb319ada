"""`pdserve bench soak`: mixed traffic at a fixed concurrency for a bounded
time against a local 2P+2D deployment with random faults at every transfer
stage, client aborts and one engine killed mid-run; then every engine must
come back idle. Prints the counts of what it survived.

PASS needs all of these (`verdict`):
- every engine idle at the end, and no request hung;
- no request refused or failed (faults, aborts and the kill are all meant to
  be survived), and at least one finished;
- every greedy answer that finished equal to the offline engine's, token
  for token;
- as many streams ended ABORTED as aborts the router accepted;
- every kind of fault fired at least once (each rule also fires on the
  first transfer that reaches its stage, so a short run exercises each path);
- no worker thread died of an exception of its own.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field

ENGINE = {"page_size": 16, "total_pages": 512, "max_scheduled_tokens": 64, "max_batch_size": 64}
OPTIONS = {"transfer_timeout_s": 3.0, "lease_s": 3.0, "heartbeat_s": 0.5}
N_TOKENS = 24
RANDOM_FAULTS = {
    "prefill": [{"stage": "post", "action": "fail", "probability": 0.05},
                {"stage": "completion", "action": "fail", "probability": 0.05}],
    "decode": [{"stage": "notification", "action": "drop", "probability": 0.03},
               {"stage": "notification", "action": "delay", "delay_s": 0.5,
                "probability": 0.05},
               {"stage": "ack", "action": "drop", "probability": 0.05}],
}
FAULT_KINDS = sorted({f"{r['stage']}:{r['action']}"      # as EngineServer.check() counts them
                      for rules in RANDOM_FAULTS.values() for r in rules})


def fault_rules(role: str) -> list[dict]:
    """Each kind once for certain (the first transfer at its stage), then at
    random without end. A rule spent or not drawn lets the next one match."""
    rules = RANDOM_FAULTS[role]
    return ([dict(r, probability=1.0, times=1) for r in rules]
            + [dict(r, times=0) for r in rules])


def verdict(counts: dict, hung: int, worker_errors: list, leaks: list,
            fired: dict) -> dict[str, bool]:
    """Each PASS condition by name (see the module docstring)."""
    return {
        "every engine idle": not leaks,
        "no request hung": not hung,
        "no worker thread lost": not worker_errors,
        "nothing refused or failed": counts["refused_or_failed"] == 0,
        "something finished": counts["finished"] > 0,
        "every finished answer matched": counts["matched_reference"] == counts["finished"],
        "aborts issued == streams ended ABORTED":
            counts["aborted_by_client"] == counts["aborts_issued"],
        "every fault kind fired": all(fired.get(k) for k in FAULT_KINDS),
    }


class Traffic:
    """The client side: `concurrency` workers, each sending one request after
    another through `client` (a pdserve Client) until `stop_at`, a tenth of
    them aborted after their first tokens."""

    def __init__(self, client, prompts: list, reference: dict, seed: int):
        self.client, self.prompts, self.reference, self.seed = client, prompts, reference, seed
        self.counts = {"requests": 0, "finished": 0, "matched_reference": 0,
                       "aborts_issued": 0, "aborts_too_late": 0, "aborted_by_client": 0,
                       "refused_or_failed": 0}
        self.failures: list[str] = []           # the first few refusals, to say what broke
        self.worker_errors: list[str] = []      # exceptions that ended a worker thread
        self.lock = threading.Lock()

    def _count(self, key: str, note: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if note and len(self.failures) < 10:
                self.failures.append(note)

    def _abort(self, rid: str) -> None:
        import grpc

        try:
            accepted = self.client.abort(rid)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            accepted = False                   # it finished first
        self._count("aborts_issued" if accepted else "aborts_too_late")

    def one(self, r: random.Random, rid: str) -> None:
        import grpc

        prompt = r.choice(self.prompts)
        abort_after = r.random() < 0.1
        got = []
        try:
            for chunk in self.client.generate_stream(prompt, request_id=rid,
                                                     max_tokens=N_TOKENS, ignore_eos=True):
                got += chunk.token_ids
                if abort_after and got:
                    abort_after = False
                    self._abort(rid)
        except grpc.RpcError as e:
            self._count("requests")
            if e.code() == grpc.StatusCode.ABORTED:
                self._count("aborted_by_client")
            else:
                self._count("refused_or_failed", f"{rid}: {e.code().name}: {e.details()}")
            return
        with self.lock:
            self.counts["requests"] += 1
            self.counts["finished"] += 1
            self.counts["matched_reference"] += got == self.reference[prompt]

    def worker(self, wid: int, stop_at: float) -> None:
        r = random.Random(self.seed * 1000 + wid)
        i = 0
        try:
            while time.monotonic() < stop_at:
                self.one(r, f"soak-{wid}-{i}")
                i += 1
        except Exception:                       # counted: a lost worker fails the run
            with self.lock:
                self.worker_errors.append(f"worker {wid}: {traceback.format_exc()}")


def _settle(dep, bound: float = 60.0) -> dict:
    """Poll every engine of the Deployment `dep` with check() until all are
    idle or `bound` passed."""
    import ray

    deadline = time.monotonic() + bound
    while True:
        states = {}
        for name, _, actor in dep.engines:
            try:
                states[name] = ray.get(actor.check.remote(), timeout=10)
            except Exception:                   # still restarting
                states[name] = {"idle": False}
        if all(s["idle"] for s in states.values()) or time.monotonic() > deadline:
            return states


def _workload(seed: int) -> tuple[list, dict]:
    """Prompts sharing six prefixes, and each one's greedy answer offline."""
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.llm import LLM

    rng = random.Random(seed)
    prefixes = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(10, 200)))
                for _ in range(6)]
    prompts = [p + "".join(rng.choice("xyz") for _ in range(rng.randrange(1, 20)))
               for p in prefixes for _ in range(8)]
    sp = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    outs = LLM(**ENGINE).generate(prompts, sp, use_tqdm=False)  # type: ignore[arg-type]
    return prompts, {p: o.token_ids for p, o in zip(prompts, outs)}


@dataclass
class Outcome:
    """What a soak run saw besides the traffic's counts (its defaults: what
    a run that broke before the end reports)."""
    victim: str = "none"                       # the prefill engine killed mid-run
    hung: int = 0                              # worker threads still running at the end
    resubmitted: int = 0                       # requests the router sent again
    leaks: list = field(default_factory=lambda: ["(never checked)"])   # engines not idle
    fired: dict = field(default_factory=dict)  # fault kind -> times it fired
    survived: dict = field(default_factory=lambda: {
        "transfer_failures": 0, "lease_expiries": 0, "transfers": 0})


def main(seconds: float = 60.0, concurrency: int = 32, seed: int = 0) -> int:
    from pdserve.client import Client
    from pdserve.config import ServeConfig
    from pdserve.cluster.deploy import Deployment

    prompts, reference = _workload(seed)
    cfg = ServeConfig.from_dict({"engine": ENGINE,
                                 "cluster": {"prefill": 2, "decode": 2, "fused": 0}})
    dep = Deployment(cfg, num_cpus=2, engine_options=OPTIONS)
    dep.start()
    outcome = Outcome()
    traffic = Traffic(Client(dep.address, timeout=120), prompts, reference, seed)
    try:
        _chaos(dep, traffic, seconds, concurrency, seed, outcome)
    finally:
        dep.stop()
    return _report(traffic, outcome, seconds, concurrency, seed)


def _chaos(dep, traffic: Traffic, seconds: float, concurrency: int, seed: int,
           outcome: Outcome) -> None:
    """Faults armed on every engine, the traffic for `seconds`, a prefill
    engine killed halfway, then every engine polled until idle; what it
    saw goes into `outcome` as it happens."""
    import ray

    for name, role, actor in dep.engines:
        # crc32, not hash(): str hashes differ between processes, seeds must not
        ray.get(actor.set_faults.remote(fault_rules(role),
                                        seed + zlib.crc32(name.encode()) % 1000))
    stop_at = time.monotonic() + seconds
    threads = [threading.Thread(target=traffic.worker, args=(w, stop_at))
               for w in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(seconds / 2)                       # mid-run, by the clock: the chaos event
    outcome.victim = random.Random(seed).choice(
        [n for n, role, _ in dep.engines if role == "prefill"])
    # what the victim fired so far: its own count dies with it
    outcome.fired = dict(ray.get(dep.actor(outcome.victim).check.remote(),
                                 timeout=30)["faults_fired"])
    ray.kill(dep.actor(outcome.victim), no_restart=False)
    join_by = time.monotonic() + seconds + 180
    for t in threads:
        t.join(max(0.0, join_by - time.monotonic()))
    outcome.hung = sum(t.is_alive() for t in threads)
    states = _settle(dep)
    for s in states.values():
        for k, v in s.get("faults_fired", {}).items():
            outcome.fired[k] = outcome.fired.get(k, 0) + v
        for k in outcome.survived:
            outcome.survived[k] += s.get("counters", {}).get(k, 0)
    outcome.leaks = [n for n, s in states.items() if not s["idle"]]
    outcome.resubmitted = dep.router.counters["resubmitted"]


def _report(traffic: Traffic, outcome: Outcome, seconds: float, concurrency: int,
            seed: int) -> int:
    """The counts, each failed PASS condition, and the verdict: 0 on PASS."""
    o = outcome
    print(f"soak: {seconds:.0f} s at concurrency {concurrency}, seed {seed}, "
          f"2 prefill + 2 decode engines, {o.victim} killed mid-run")
    for k, v in traffic.counts.items():
        print(f"  {k:<22} {v}")
    print(f"  {'resubmitted':<22} {o.resubmitted}")
    print(f"  {'hung requests':<22} {o.hung}")
    print(f"  {'lost worker threads':<22} {len(traffic.worker_errors)}")
    for k in FAULT_KINDS:
        print(f"  fault {k:<16} {o.fired.get(k, 0)}")
    for k, v in o.survived.items():
        print(f"  {k:<22} {v} (counted by engines alive at the end)")
    print(f"  {'engines not idle':<22} {o.leaks or 'none'}")
    checks = verdict(traffic.counts, o.hung, traffic.worker_errors, o.leaks, o.fired)
    for what, ok in checks.items():
        if not ok:
            print(f"  FAILED: {what}")
    for note in traffic.failures + traffic.worker_errors:
        print(f"  {note}")
    ok = all(checks.values())
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="how long, seconds (60)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (16)")
    p.add_argument("--seed", type=int, default=0, help="reproduces a run (0)")


def run(args) -> int:
    return main(args.seconds, args.concurrency, args.seed)
