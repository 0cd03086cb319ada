"""`pdserve demo` (what `make demo` runs): start a local 1P+1D deployment on
the tiny model, send a few prompts at once, print each answer as it streams
in, print every engine's stats, and shut down."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from pdserve.client import Client
from pdserve.cluster.config import load_config
from pdserve.cluster.deploy import Deployment

PROMPTS = [
    "The quick brown fox",
    "Disaggregated serving splits prefill and decode",
    "The quick brown fox jumps over",          # shares a prefix with the first
    "KV pages move over NIXL",
]


def main(config: str | None = None) -> int:
    path = config or str(Path(__file__).resolve().parents[1] / "deploy" / "local-pd.yaml")
    cfg = load_config(path)
    print(f"starting a local deployment from {path} ...", flush=True)
    t0 = time.time()
    dep = Deployment(cfg, num_cpus=2)
    try:
        addr = dep.start()
        print(f"router on {addr} after {time.time() - t0:.1f} s", flush=True)
        client = Client(addr, timeout=120)
        lock = threading.Lock()
        answers: dict[int, str] = {}

        def ask(i: int, prompt: str) -> None:
            text = ""
            for chunk in client.generate_stream(prompt, max_tokens=24, temperature=0.8, seed=i,
                                                ignore_eos=True):
                text += chunk.text
                engine = chunk.engine
                if chunk.text:
                    with lock:
                        print(f"  [{i}] +{chunk.text!r}", flush=True)
            answers[i] = f"{prompt!r} -> {text!r} (decoded on {engine})"
        threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("\nanswers:")
        for i in sorted(answers):
            print(f"  [{i}] {answers[i]}")
        print("\nengines:")
        for s in client.stats():
            print(f"  {s['name']:<18} {s['role']:<8} pages used {s['used_pages']}/"
                  f"{s['total_pages']} pinned {s['pinned_pages']}  running {s['running']} "
                  f"waiting {s['waiting']}  finished {s['finished']} transfers {s['transfers']}")
    finally:
        dep.stop()
    return 0
