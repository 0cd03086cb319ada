"""`pdserve generate TEXT...`: generate from a running deployment's router
(--address, streamed) or offline in this process (`pdserve.LLM` on --config,
--model, or both: the model flags over the file, as `pdserve up` takes them)."""

from __future__ import annotations

import sys

from pdserve.benchmarks.common.options import client_key, client_key_argument
from pdserve.benchmarks.common.options import add_model_arguments, flags_from, model_flags_given
from pdserve.cli.remote import said


def add_arguments(p) -> None:
    p.add_argument("--address", help="the router of a running deployment, HOST:PORT")
    p.add_argument("--config", help="config YAML (model and engine), offline")
    add_model_arguments(p, shape=False)     # one fused engine: no engine counts
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    # its own dest: cuda:N is no model.device, so it goes to the LLM, not into the config
    p.add_argument("--device", dest="offline_device",
                   help="offline: cpu, cuda or cuda:N (default: the config's model.device; "
                        "auto is cpu)")
    client_key_argument(p)
    p.add_argument("text", nargs="+", help="one or more prompts")


def run(args) -> int:
    flags = flags_from(args)
    if args.address:
        offline = model_flags_given(flags) + (["--device"] if args.offline_device else [])
        if offline:
            print(f"pdserve: error: {', '.join(offline)} with --address: --dtype and --device "
                  "apply offline (--config or --model), as do the other model flags; a running "
                  "deployment serves its own config's model", file=sys.stderr)
            return 2
        return said(lambda: _remote(args))
    if args.config is None and flags.model_path is None and flags.model_preset is None:
        print("pdserve: error: generate needs --address HOST:PORT (a running deployment), "
              "or --config FILE or --model PATH (offline, in-process)", file=sys.stderr)
        return 2
    return _offline(args, flags)


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


def _offline(args, flags) -> int:
    from pdserve.config import load_with_flags
    from pdserve.text.sampling_params import SamplingParams
    from pdserve.llm import LLM

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, seed=args.seed, **_penalties(args))
    cfg, _ = load_with_flags(args.config, flags)
    with LLM(cfg, device=args.offline_device) as llm:
        outs = llm.generate(args.text, sp, use_tqdm=False)
    for i, (text, out) in enumerate(zip(args.text, outs)):
        print(f"[{i}] {text!r} -> {out.text}" if len(args.text) > 1 else out.text)
    return 0


def _penalties(args) -> dict:
    return {"presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty,
            "repetition_penalty": args.repetition_penalty, "min_p": args.min_p}
