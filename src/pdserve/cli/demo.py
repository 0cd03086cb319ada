"""`pdserve demo` (what `make demo` runs): start a local 1P+1D deployment of
SmolLM2-135M-Instruct, ask it a few questions at once over gRPC, print each
answer as it streams in, ask one more through the OpenAI-compatible HTTP
API, print every engine's stats, and shut down."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "What is the capital of Germany?",          # shares the chat template's prefix
    "Write one sentence about the sea.",
]


def add_arguments(p) -> None:
    p.add_argument("--config", default=None, help="config YAML (default: deploy/local-pd.yaml)")


def run(args) -> int:
    return main(args.config)


def main(config: str | None = None) -> int:
    # here, not at the top: `pdserve demo --help` imports no Ray, gRPC or torch
    from pdserve.client import Client
    from pdserve.cluster.deploy import Deployment
    from pdserve.config import load_config
    from pdserve.text.chat import render_chat

    path = config or "deploy/local-pd.yaml"          # the shipped one unless a file is here
    cfg = load_config(path)
    print(f"starting a local deployment from {path} ...", flush=True)
    t0 = time.time()
    dep = Deployment(cfg, num_cpus=2)
    try:
        addr = dep.start(http_port=0)
        http = dep.http_address
        assert dep.router is not None and http is not None   # started, with an HTTP port
        print(f"router on {addr} (gRPC) and {http} (OpenAI HTTP) after "
              f"{time.time() - t0:.1f} s; model {cfg.model.served_name}", flush=True)
        client = Client(addr, timeout=300)
        tok = dep.router.tokenizer
        lock = threading.Lock()
        answers: dict[int, str] = {}

        def prompt_for(question: str) -> str:
            template = getattr(tok, "chat_template", None)
            if not template:                       # a model without one: the bare question
                return question
            return render_chat(template, [{"role": "user", "content": question}],
                               bos_token=tok.bos_token, eos_token=tok.eos_token)

        def ask(i: int, question: str) -> None:
            text, engine = "", ""
            for chunk in client.generate_stream(prompt_for(question), max_tokens=48,
                                                temperature=0):
                text += chunk.text
                engine = chunk.engine
                if chunk.text:
                    with lock:
                        print(f"  [{i}] +{chunk.text!r}", flush=True)
            answers[i] = f"{question!r} -> {text.strip()!r} (decoded on {engine})"
        threads = [threading.Thread(target=ask, args=(i, q)) for i, q in enumerate(QUESTIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("\nanswers (gRPC, streamed):")
        for i in sorted(answers):
            print(f"  [{i}] {answers[i]}")
        print("\nthe same server over OpenAI HTTP (POST /v1/chat/completions):")
        question = "What is 2 + 2?"
        body = {"model": cfg.model.served_name, "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "user", "content": question}]}
        req = urllib.request.Request(http + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            out = json.loads(resp.read())
        print(f"  {question!r} -> {out['choices'][0]['message']['content']!r}  "
              f"usage {out['usage']}")
        print("\nengines:")
        for s in client.stats():
            print(f"  {s['name']:<18} {s['role']:<8} pages used {s['used_pages']}/"
                  f"{s['total_pages']} pinned {s['pinned_pages']}  running {s['running']} "
                  f"waiting {s['waiting']}  finished {s['finished']} transfers {s['transfers']}")
    finally:
        dep.stop()
    return 0
