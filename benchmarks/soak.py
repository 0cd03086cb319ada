"""`pdserve bench soak`: mixed traffic at a fixed concurrency for a bounded
time against a local 2P+2D deployment with random faults at every transfer
stage, client aborts and one engine killed mid-run; then every engine must
come back idle. Greedy answers that were not aborted must equal the offline
engine's, token for token. Prints the counts of what it survived.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import ray

from pdserve.client import Client
from pdserve.cluster.config import ServeConfig
from pdserve.cluster.deploy import Deployment
from pdserve.kernels.sampling import SamplingParams
from pdserve.llm import LLM

ENGINE = {"page_size": 16, "total_pages": 512, "max_scheduled_tokens": 64, "max_batch_size": 64}
OPTIONS = {"transfer_timeout_s": 3.0, "lease_s": 3.0, "heartbeat_s": 0.5}
FAULTS = {
    "prefill": [{"stage": "post", "action": "fail", "probability": 0.05, "times": 0},
                {"stage": "completion", "action": "fail", "probability": 0.05, "times": 0}],
    "decode": [{"stage": "notification", "action": "drop", "probability": 0.03, "times": 0},
               {"stage": "notification", "action": "delay", "delay_s": 0.5,
                "probability": 0.05, "times": 0},
               {"stage": "ack", "action": "drop", "probability": 0.05, "times": 0}],
}


def main(seconds: float = 60.0, concurrency: int = 32, seed: int = 0) -> int:
    rng = random.Random(seed)
    prefixes = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(10, 200)))
                for _ in range(6)]
    prompts = [p + "".join(rng.choice("xyz") for _ in range(rng.randrange(1, 20)))
               for p in prefixes for _ in range(8)]
    n_tokens = 24
    sp = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    reference = {p: o.token_ids for p, o in zip(prompts, LLM(**ENGINE).generate(
        prompts, sp, use_tqdm=False))}
    cfg = ServeConfig.from_dict({"engine": ENGINE,
                                 "cluster": {"prefill": 2, "decode": 2, "fused": 0}})
    dep = Deployment(cfg, num_cpus=2, engine_options=OPTIONS)
    dep.start()
    counts = {"requests": 0, "finished": 0, "matched_reference": 0, "aborted_by_client": 0,
              "refused_or_failed": 0}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds
    try:
        for name, role, actor in dep.engines:
            ray.get(actor.set_faults.remote(FAULTS[role], seed + hash(name) % 1000))
        client = Client(dep.address, timeout=120)

        def worker(wid: int) -> None:
            r = random.Random(seed * 1000 + wid)
            i = 0
            while time.monotonic() < stop_at:
                prompt = r.choice(prompts)
                rid = f"soak-{wid}-{i}"
                i += 1
                abort_after = r.random() < 0.1
                try:
                    got = []
                    for chunk in client.generate_stream(prompt, request_id=rid,
                                                        max_tokens=n_tokens, ignore_eos=True):
                        got += chunk.token_ids
                        if abort_after and got:
                            client.abort(rid)
                            abort_after = False
                    with lock:
                        counts["requests"] += 1
                        counts["finished"] += 1
                        counts["matched_reference"] += got == reference[prompt]
                except grpc.RpcError as e:
                    with lock:
                        counts["requests"] += 1
                        key = "aborted_by_client" if e.code() == grpc.StatusCode.ABORTED \
                            else "refused_or_failed"
                        counts[key] += 1
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
        for t in threads:
            t.start()
        time.sleep(seconds / 2)                       # mid-run, by the clock: the chaos event
        victim = rng.choice([n for n, role, _ in dep.engines if role == "prefill"])
        ray.kill(dep.actor(victim), no_restart=False)
        for t in threads:
            t.join(seconds + 180)
        hung = sum(t.is_alive() for t in threads)
        deadline = time.monotonic() + 60
        while True:
            states = {}
            for name, _, actor in dep.engines:
                try:
                    states[name] = ray.get(actor.check.remote(), timeout=10)
                except Exception:                     # still restarting
                    states[name] = {"idle": False}
            if all(s["idle"] for s in states.values()) or time.monotonic() > deadline:
                break
        fired: dict[str, int] = {}
        survived = {"transfer_failures": 0, "lease_expiries": 0, "transfers": 0}
        for s in states.values():
            for k, v in s.get("faults_fired", {}).items():
                fired[k] = fired.get(k, 0) + v
            for k in survived:
                survived[k] += s.get("counters", {}).get(k, 0)
        leaks = [n for n, s in states.items() if not s["idle"]]
    finally:
        resubmitted = dep.router.counters["resubmitted"] if dep.router else 0
        dep.stop()
    print(f"soak: {seconds:.0f} s at concurrency {concurrency}, seed {seed}, "
          f"2 prefill + 2 decode engines, {victim} killed mid-run")
    for k, v in counts.items():
        print(f"  {k:<22} {v}")
    print(f"  {'resubmitted':<22} {resubmitted}")
    print(f"  {'hung requests':<22} {hung}")
    for k, v in sorted(fired.items()):
        print(f"  fault {k:<16} {v}")
    for k, v in survived.items():
        print(f"  {k:<22} {v} (counted by engines alive at the end)")
    print(f"  {'engines not idle':<22} {leaks or 'none'}")
    ok = not leaks and not hung and counts["matched_reference"] == counts["finished"]
    print("soak: PASS" if ok else "soak: FAIL")
    return 0 if ok else 1
