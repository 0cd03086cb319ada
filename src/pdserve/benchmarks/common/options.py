"""Options more than one command shares: argument types, option groups two
benchmarks define alike, the API key of a command that calls a router, and
the usage error. The `pdserve` command imports them from here (cli/ may
import benchmarks, not the reverse); no benchmark imports the command. The model flags `up`, `generate` and `bench serve`
share, by vLLM's names with SGLang's as aliases (`--model-path`, `--tp`,
`--context-length`), are the parser's half of config/flags.py, which puts
them over the config file."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from pdserve.config import DTYPES, Flags, model_source


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def non_negative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return n


def workload_arguments(p: argparse.ArgumentParser) -> None:
    """Synthetic requests sent to a deployment (serve, sim-accuracy)."""
    p.add_argument("--requests", type=int, default=64, help="how many (64)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each synthetic prompt (128)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (64)")


def sim_arguments(p: argparse.ArgumentParser) -> None:
    """A simulated deployment replaying a trace (disagg, retraction)."""
    p.add_argument("--config", help="config YAML of the simulated deployment")
    p.add_argument("--trace", help="trace JSONL (ours or Mooncake) or Azure CSV")
    p.add_argument("--limit", type=int, help="only the first N requests of the trace")


def usage_error(message: str) -> int:
    """A combination of options argparse cannot check: said, exit status 2."""
    print(f"pdserve: error: {message}", file=sys.stderr)
    return 2


def client_key_argument(p: argparse.ArgumentParser) -> None:
    """--api-key for a command that calls a running deployment's router."""
    p.add_argument("--api-key", default=None,
                   help="the deployment's API key, if it was started with one (default "
                        "$PDSERVE_API_KEY)")


def client_key(args) -> str | None:
    return args.api_key or os.environ.get("PDSERVE_API_KEY") or None


def add_model_arguments(p: argparse.ArgumentParser, *, positional: bool = False,
                        shape: bool = True) -> None:
    """`positional`: MODEL may also come first, as in `vllm serve MODEL`;
    `shape`: the engine counts (a deployment's, not one in-process engine's)."""
    what = ("a checkpoint directory, a .gguf file or a preset (tiny, smollm2-135m); "
            "replaces the config's model")
    if positional:
        p.add_argument("model_arg", nargs="?", metavar="MODEL", help=what)
    p.add_argument("--model", "--model-path", dest="model", metavar="PATH", help=what)
    p.add_argument("--served-model-name", metavar="NAME",
                   help="what clients call the model (model.name; default: the checkpoint's "
                        "folder or file name)")
    p.add_argument("--dtype", choices=DTYPES, help="the model's dtype (model.dtype)")
    p.add_argument("--tensor-parallel-size", "-tp", "--tp", "--tp-size", type=int,
                   dest="tensor_parallel_size", metavar="T",
                   help="ranks (processes, GPUs) each engine's model is split over "
                        "(engine.tensor_parallel_size; replaces each role's own size)")
    p.add_argument("--enable-expert-parallel", "--ep", action="store_const", const=True,
                   default=None, dest="enable_expert_parallel",
                   help="a mixture-of-experts model's experts sharded whole over the "
                        "tensor-parallel ranks, not each split (model.expert_parallel)")
    if shape:
        p.add_argument("--prefill", type=int, metavar="N",
                       help="prefill engines; the counts given (--prefill, --decode, --fused) "
                            "name every engine there is, an omitted role none, replacing the "
                            "config's cluster")
        p.add_argument("--decode", type=int, metavar="N", help="decode engines (see --prefill)")
        p.add_argument("--fused", type=int, metavar="N", help="fused engines (see --prefill)")
    p.add_argument("--max-model-len", "--context-length", type=int, metavar="TOKENS",
                   dest="max_model_len",
                   help="a request's prompt and output together at most (engine."
                        "max_context_tokens; default: the model's context)")
    p.add_argument("--max-num-seqs", "--max-running-requests", type=int, metavar="N",
                   dest="max_num_seqs", help="requests in one forward (engine.max_batch_size)")
    p.add_argument("--max-num-batched-tokens", "--chunked-prefill-size", type=int,
                   metavar="TOKENS", dest="max_num_batched_tokens",
                   help="prompt and decode tokens a round at most (engine."
                        "max_scheduled_tokens)")


def flags_from(args: argparse.Namespace) -> Flags:
    """The Flags of parsed arguments (a parser that lacks a flag: not given)."""
    def given(name: str, default=None):
        return getattr(args, name, default)

    model = _model(given("model_arg"), given("model"))
    fields = {f.name: given(f.name) for f in dataclasses.fields(Flags)
              if f.name not in ("model_path", "model_preset", "lora_modules",
                                "insecure_control_plane")}
    return Flags(**model, **fields, lora_modules=tuple(given("lora_modules", ()) or ()),
                 insecure_control_plane=bool(given("insecure_control_plane", False)))


def _model(positional: str | None, flag: str | None) -> dict:
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"two models: MODEL {positional!r} and --model {flag!r}; give one")
    value = positional if positional is not None else flag
    if value is None:
        return {}
    from pdserve.kernels.models.loader import PRESETS      # torch: only once a model is named

    return model_source(value, PRESETS)


def model_flags_given(flags: Flags) -> list[str]:
    """The model and limit flags given (not the engine counts): what applies
    only where a model is loaded."""
    names = {"model_path": "--model", "model_preset": "--model",
             "served_model_name": "--served-model-name", "dtype": "--dtype",
             "tensor_parallel_size": "--tensor-parallel-size",
             "enable_expert_parallel": "--enable-expert-parallel",
             "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
             "max_num_batched_tokens": "--max-num-batched-tokens"}
    return sorted({flag for field, flag in names.items() if getattr(flags, field) is not None})
