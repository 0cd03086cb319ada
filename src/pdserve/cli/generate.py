"""`pdserve generate TEXT...`: generate from a running deployment's router
(--address, streamed) or offline in this process (--config, `pdserve.LLM`)."""

from __future__ import annotations

import sys

from pdserve.benchmarks.args import client_key, client_key_argument
from pdserve.cli.remote import said


def add_arguments(p) -> None:
    p.add_argument("--address", help="the router of a running deployment, HOST:PORT")
    p.add_argument("--config", help="config YAML (model and engine), offline")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--device", help="offline: cpu, cuda or cuda:N (default: the config's "
                                    "model.device; auto is cpu)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="offline: overrides the config's model.dtype")
    client_key_argument(p)
    p.add_argument("text", nargs="+", help="one or more prompts")


def run(args) -> int:
    if args.address:
        if args.dtype or args.device is not None:
            print("pdserve: error: --dtype and --device apply offline (--config); a running "
                  "deployment uses its own config's model.dtype and devices", file=sys.stderr)
            return 2
        return said(lambda: _remote(args))
    if args.config is None:
        print("pdserve: error: generate needs --address HOST:PORT (a running deployment) "
              "or --config FILE (offline, in-process)", file=sys.stderr)
        return 2
    return _offline(args)


def _remote(args) -> int:
    from pdserve.client import Client

    c = Client(args.address, api_key=client_key(args))
    for i, text in enumerate(args.text):
        if len(args.text) > 1:
            print(f"[{i}] {text!r} ->", end=" ", flush=True)
        for chunk in c.generate_stream(text, max_tokens=args.max_tokens,
                                       temperature=args.temperature, top_p=args.top_p,
                                       top_k=args.top_k, seed=args.seed, **_penalties(args)):
            print(chunk.text, end="", flush=True)
        print()
    return 0


def _offline(args) -> int:
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.llm import LLM

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, **_penalties(args))
    llm = LLM(args.config, device=args.device, dtype=args.dtype)
    for i, (text, out) in enumerate(zip(args.text, llm.generate(args.text, sp, use_tqdm=False))):
        print(f"[{i}] {text!r} -> {out.text}" if len(args.text) > 1 else out.text)
    return 0


def _penalties(args) -> dict:
    return {"presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty,
            "repetition_penalty": args.repetition_penalty, "min_p": args.min_p}
