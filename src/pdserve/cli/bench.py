"""`pdserve bench NAME`: the registry of benchmarks. Each module defines its
options (`add_arguments`) and runs on them (`run`); only the chosen one is
imported, and `pdserve bench --help` lists them all from here."""

from __future__ import annotations

from pdserve.cli.subcommands import Subcommand, add_subcommands, chosen

ABOUT = "benchmarks that print a table; each has its own options: pdserve bench NAME --help"
BENCHMARKS = [
    Subcommand("planner", "pdserve.benchmarks.planner.build_cost", "plan-build cost per round"),
    Subcommand("retraction", "pdserve.benchmarks.planner.retraction",
               "a tight pool with the host cache off and on, and every request strict"),
    Subcommand("disagg", "pdserve.benchmarks.planner.disagg",
               "fused against P/D splits across request rates"),
    Subcommand("llm", "pdserve.benchmarks.engine.llm", "pdserve.LLM against Hugging Face generate"),
    Subcommand("transfer", "pdserve.benchmarks.transfer.handoff",
               "KV handoff over NIXL against raw NIXL and memcpy"),
    Subcommand("serve", "pdserve.benchmarks.serving.serve", "load a deployment through the client"),
    Subcommand("control-plane", "pdserve.benchmarks.serving.control_plane",
               "a control call over mutual TLS against plaintext"),
    Subcommand("soak", "pdserve.benchmarks.serving.soak",
               "faults, aborts and a killed engine under load"),
    Subcommand("tokens", "pdserve.benchmarks.serving.tokens",
               "what a generated token costs on its way out of an engine"),
    Subcommand("cache-groups", "pdserve.benchmarks.cache.groups",
               "Gemma 3 27B's sliding-window groups against every layer full (per-request "
               "bytes, concurrency, a simulated trace)"),
    Subcommand("state-capacity", "pdserve.benchmarks.cache.state_capacity",
               "Qwen3-Next-80B's snapshot-state groups against vLLM-style pages and every "
               "layer attention (requests of a long prompt one node's pool holds)"),
    Subcommand("state-reuse", "pdserve.benchmarks.cache.state_reuse",
               "prefix hits on Qwen3-Next-80B with state checkpoints on and off, fused and P/D "
               "(the Mooncake conversation trace, simulated)"),
    Subcommand("sim-accuracy", "pdserve.benchmarks.planner.sim_accuracy",
               "the simulator with a calibrated profile against the real deployment at "
               "concurrency 1 and fractions of saturation, also at the engines' own speed in "
               "each run"),
    Subcommand("autoscale", "pdserve.benchmarks.serving.autoscale",
               "a sine load against 1P+1D fixed and autoscaled"),
    Subcommand("sampling", "pdserve.benchmarks.kernels.sampling",
               "a round's logits to tokens on a real model's vocabulary, against the sampler "
               "before"),
    Subcommand("lora", "pdserve.benchmarks.kernels.lora",
               "a batch under 1, 4 and 16 distinct LoRA adapters against the base model, and "
               "an adapter's load time"),
    Subcommand("quantized", "pdserve.benchmarks.kernels.quantized",
               "a GGUF's decode round with its weights kept quantized against bfloat16 and "
               "float32 dequantized, and what it changes in the logits"),
    Subcommand("disk", "pdserve.benchmarks.cache.disk",
               "the disk KV tier on the CPU engine: a multi-turn replay with host alone and "
               "host + disk, a warm restart against a cold one, the cost when every probe "
               "misses"),
    Subcommand("peer", "pdserve.benchmarks.serving.peer",
               "pdserve against llama.cpp's llama-server on the same GGUF, at concurrency 1, "
               "8 and 32 (skipped without llama-server)"),
    Subcommand("spec", "pdserve.benchmarks.spec.ngram",
               "speculative decoding (n-gram lookup) against plain decoding on an "
               "input-grounded workload at concurrency 1, 4 and 16, and P/D against fused"),
    Subcommand("structured", "pdserve.benchmarks.structured.throughput",
               "structured outputs' cost: output tokens/s at 0, 50 and 100 percent of requests "
               "constrained to JSON schemas, mask CPU time per token, compile p50/p99, fused "
               "and 1P+1D"),
    Subcommand("loop", "pdserve.benchmarks.engine.loop",
               "where a fused engine's round goes (planner, forward, sampling), and what "
               "overlapping the planner with the forward could save"),
    Subcommand("capture", "pdserve.benchmarks.kernels.capture",
               "the captured decode step (CUDA graphs; torch.compile on CPU) against the eager "
               "one at batch 1, 16 and 64, and the capture's time at load"),
    Subcommand("gpu", "pdserve.benchmarks.engine.gpu",
               "the engine's decode step and prefill on a GPU against the card's copy "
               "bandwidth and matmul peak measured in the same run, the capture at load, "
               "and transformers on the same shape (--dry-run: the same on CPU, tiny)"),
    Subcommand("mla", "pdserve.benchmarks.kernels.mla",
               "latent attention absorbed against expanded on DeepSeek-V3's shape: decode "
               "batches and prefill chunks"),
    Subcommand("moe", "pdserve.benchmarks.engine.moe",
               "a small mixture-of-experts model against the dense model of the same active "
               "parameters at batch 1 and 32, and its experts split or sharded at TP 2"),
    Subcommand("tp-plan", "pdserve.benchmarks.engine.tp_plan",
               "what sending a round to a tensor-parallel engine's other ranks costs, at 1, "
               "64 and 256 running requests"),
    Subcommand("tp-pd", "pdserve.benchmarks.transfer.tp_pd",
               "one request's KV moved between prefill and decode engines of tensor-parallel "
               "sizes 1 and 2, each pair: time and bytes per rank"),
]


def add_arguments(p) -> None:
    p.description = ABOUT
    add_subcommands(p, BENCHMARKS, dest="what", metavar="BENCHMARK", describe=True)


def run(args) -> int:
    return chosen(BENCHMARKS, args.what).run(args)
