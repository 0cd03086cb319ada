"""`pdserve bench lora`: a batch under 1, 4 and 16 distinct LoRA adapters
against the base model at the same batch, and what loading an adapter costs.

One `pdserve.LLM` (SmolLM2-135M by default, on CPU) serves `--adapters`
random PEFT adapters (rank `--rank` on q, k, v, o, gate, up and down, written
to a temporary directory as PEFT saves them) in as many device slots. Each
repeat runs every case once, in turn, on the same prompts: `--batch`
requests of `--prompt-tokens` tokens generating `--tokens` each (greedy,
EOS ignored), all under the base model, all under one adapter, or spread
round-robin over 4 or 16. Throughput is generated tokens over the wall time
of the whole generate call (prefill included); the table gives the median
and the spread over `--repeats`, and each case's median against the base's.
Then an adapter's load: its PEFT directory read into host memory, and host
memory copied into a device slot.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.benchmarks.args import positive

CASES = (("base", 0), ("1 adapter", 1), ("4 adapters", 4), ("16 adapters", 16))


def add_arguments(p) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="model preset (smollm2-135m)")
    p.add_argument("--batch", type=positive, default=16, help="requests a generate (16)")
    p.add_argument("--prompt-tokens", type=positive, default=32)
    p.add_argument("--tokens", type=positive, default=32, help="generated per request")
    p.add_argument("--rank", type=positive, default=16, help="adapter rank (16)")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--device", default="cpu")


def write_random_adapter(d: Path, cfg, rank: int, seed: int) -> Path:
    """A random adapter for a model of `cfg`, as PEFT saves one."""
    import torch
    from safetensors.torch import save_file

    from pdserve.kernels.lora_adapter import MODULES, module_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in MODULES:
            out, inp = module_shape(cfg, m)
            part = "self_attn" if m in MODULES[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{m}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp ** .5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
         "bias": "none"}))
    return d


def run(args) -> int:
    from pdserve import LLM, SamplingParams
    from pdserve.kernels.loader import model_config_for
    from pdserve.kernels.lora_adapter import load_adapter

    n = max(k for _, k in CASES)
    cfg = model_config_for(None, args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {f"a{i}": str(write_random_adapter(Path(tmp) / f"a{i}", cfg, args.rank, i))
                for i in range(n)}
        llm = LLM({"model": {"preset": args.preset},
                   "engine": {"max_batch_size": max(args.batch, 16)},
                   "lora": {"adapters": dirs, "max_loras": n, "max_lora_rank": args.rank}},
                  device=args.device, dtype="float32")
        vocab = cfg.vocab_size

        def prompts(round_: int) -> list[list[int]]:
            """Distinct prompts each round: no prefix hit makes one case cheaper."""
            return [[(7919 * round_ + 7 * i + 13 * j) % (vocab - 2) + 1
                     for j in range(args.prompt_tokens)] for i in range(args.batch)]
        sp = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        names = {label: [None] * args.batch if k == 0 else
                 [f"a{i % k}" for i in range(args.batch)] for label, k in CASES}
        for label, _ in CASES:                 # warm: every slot loaded, every path run once
            llm.generate(prompts(0), sp, use_tqdm=False, adapter=names[label])
        rates: dict[str, list[float]] = {label: [] for label, _ in CASES}
        round_ = 0
        for _ in range(args.repeats):
            for label, _ in CASES:
                round_ += 1
                ps = prompts(round_)
                t0 = time.perf_counter()
                llm.generate(ps, sp, use_tqdm=False, adapter=names[label])
                rates[label].append(args.batch * args.tokens / (time.perf_counter() - t0))
        reads, copies = [], []
        stacks = llm.model.lora
        for i in range(max(args.repeats, 3)):
            t0 = time.perf_counter()
            adapter = load_adapter(dirs[f"a{i % n}"], cfg, args.rank)
            t1 = time.perf_counter()
            stacks.load(0, adapter)
            if args.device != "cpu":
                import torch
                torch.cuda.synchronize()
            reads.append(t1 - t0)
            copies.append(time.perf_counter() - t1)
    base = statistics.median(rates["base"])
    print(f"{args.preset} on {args.device}, float32: batch {args.batch}, {args.prompt_tokens} "
          f"prompt tokens, {args.tokens} generated each, rank {args.rank} on q k v o gate up "
          f"down, {n} slots, {args.repeats} repeats")
    print(f"{'case':<14} {'tok/s (median)':>15} {'min..max':>15} {'vs base':>8}")
    for label, _ in CASES:
        r = rates[label]
        med = statistics.median(r)
        print(f"{label:<14} {med:>15.1f} {f'{min(r):.1f}..{max(r):.1f}':>15} "
              f"{med / base:>7.2f}x")
    mb = adapter.nbytes() / 2 ** 20
    print(f"adapter load ({mb:.1f} MiB): read from its PEFT directory "
          f"{1e3 * statistics.median(reads):.1f} ms (min {1e3 * min(reads):.1f}), copied into a "
          f"slot {1e3 * statistics.median(copies):.1f} ms (min {1e3 * min(copies):.1f})")
    return 0
