"""`pdserve bench lora`: a decode batch under 1, 4 and 16 distinct LoRA
adapters against the base model at the same batch, and what loading an
adapter costs.

The model (SmolLM2-135M by default) gets 16 device slots
holding 16 random PEFT adapters (rank `--rank` on q, k, v, o, gate, up and
down, written to a temporary directory as PEFT saves them). A decode round
of `--batch` sequences, each `--context` tokens into its history, is timed
through the model's forward (attention over the paged cache, every layer,
the logits): all rows under the base model, all under one adapter, or spread
round-robin over 4 or 16, under the segmented kernel (`kernels/lora/batched.py`)
and, with `--kernel both` (the default), the masked one it replaced
(`kernels/lora/masked.py`) and, on CUDA with triton, the fused Triton
kernels (`kernels/lora/fused.py`), side by side in one run. Each repeat times
every case in turn, `--rounds` forwards each; the table gives tokens a
second (batch / the median round) over `--repeats`, its spread, and each
case against the base of the same repeats: median against median, and
best against best (on a shared host the fastest repeat is the one least
disturbed by others), by wall time and, on a CPU, by the process's CPU
time (with `--threads 1` every op runs on the calling thread, and time
spent waiting for a core a shared host's other jobs hold is not counted;
they still share the memory bus and the last-level cache). Then an
adapter's load: its PEFT directory read into host memory, and host memory
copied into a device slot.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from pdserve.benchmarks.common.decode_inputs import decode_round
from pdserve.benchmarks.common.options import positive

CASES = (("base", 0), ("1 adapter", 1), ("4 adapters", 4), ("16 adapters", 16))


def add_arguments(p) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="model preset (smollm2-135m)")
    p.add_argument("--batch", type=positive, default=16, help="decode rows a round (16)")
    p.add_argument("--context", type=positive, default=256, help="history per row (256)")
    p.add_argument("--rank", type=positive, default=16, help="adapter rank (16)")
    p.add_argument("--rounds", type=positive, default=10, help="forwards a case a repeat")
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=positive, default=None,
                   help="torch CPU threads (torch's default); 1 steadies a shared host")
    p.add_argument("--kernel", choices=("segmented", "masked", "fused", "both"), default="both",
                   help="the batched LoRA to time: the torch segmented one, the masked one "
                        "it replaced, the fused Triton one (CUDA), or all that run on the "
                        "device side by side (both)")


def write_random_adapter(d: Path, cfg, rank: int, seed: int) -> Path:
    """A random adapter for a model of `cfg`, as PEFT saves one."""
    import torch
    from safetensors.torch import save_file

    from pdserve.kernels.lora.adapter import MODULES, module_shape

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
    import torch

    from pdserve.kernels.models.loader import load_model
    from pdserve.kernels.lora.fused import triton_available

    fused = args.device.startswith("cuda") and triton_available()
    if args.kernel == "fused" and not fused:
        print("bench lora: --kernel fused runs Triton's kernels on a CUDA device: give "
              "--device cuda and install triton (pip install 'pdserve[gpu]')")
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    n = max(k for _, k in CASES)
    model, _ = load_model(None, args.preset, dtype="float32", device=args.device,
                          attention="torch", quantization="none")   # dense, as its tables ran
    stacks = model.enable_lora(n, args.rank)
    adapter, reads, copies = _load_adapters(model, stacks, n, args)
    cases, rounds = _lora_rounds(stacks, args, fused)
    rates, cpu_rates = _rates(model, cases, rounds, args)
    print(f"{args.preset} on {args.device}, float32, torch attention: a decode round of "
          f"{args.batch} rows at {args.context} tokens of history; rank {args.rank} on q k v "
          f"o gate up down, {n} slots; {args.rounds} rounds x {args.repeats} repeats, "
          f"{torch.get_num_threads()} torch threads")
    width = max(len(label) for label in rates) + 2
    _table("wall time", rates, width)
    if args.device == "cpu":
        # the time the process ran on a core: what a shared host's other
        # jobs take away (waiting for a core) is not in it
        _table("CPU time", cpu_rates, width)
    _lora_alone(model, stacks, rounds, cases, args, width)
    mb = adapter.nbytes() / 2 ** 20
    print(f"adapter load ({mb:.1f} MiB, {n} loads): read from its PEFT directory "
          f"{1e3 * statistics.median(reads):.1f} ms (min {1e3 * min(reads):.1f}), copied into "
          f"a slot {1e3 * statistics.median(copies):.1f} ms (min {1e3 * min(copies):.1f})")
    return 0


def _load_adapters(model, stacks, n: int, args) -> tuple:
    """`n` random adapters written as PEFT saves them, each read and copied
    into its slot: (the last adapter, each read's seconds, each copy's)."""
    import torch

    from pdserve.kernels.lora.adapter import load_adapter

    reads, copies = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            d = write_random_adapter(Path(tmp) / f"a{i}", model.cfg, args.rank, i)
            t0 = time.perf_counter()
            adapter = load_adapter(d, model.cfg, args.rank)
            t1 = time.perf_counter()
            stacks.load(i, adapter)
            if args.device != "cpu":
                torch.cuda.synchronize()
            reads.append(t1 - t0)
            copies.append(time.perf_counter() - t1)
    return adapter, reads, copies


def _lora_rounds(stacks, args, fused: bool) -> tuple[list, dict]:
    """The cases (label, adapters, kernel) of `--kernel`, and each one's
    batched LoRA for a round (None: the base model)."""
    from pdserve.kernels.lora.batched import LoraRound
    from pdserve.kernels.lora.fused import FusedLoraRound
    from pdserve.kernels.lora.masked import MaskedLoraRound

    kernels = {"segmented": LoraRound.of, "masked": MaskedLoraRound, "fused": FusedLoraRound.of}
    if args.kernel != "both":
        chosen = [args.kernel]
    else:
        chosen = ["segmented", "masked"] + (["fused"] if fused else [])
    cases = [("base", 0, None)] + [(f"{label}, {k}" if len(chosen) > 1 else label, n_ad, k)
                                    for k in chosen for label, n_ad in CASES if n_ad]
    rounds = {}
    for label, k, kernel in cases:
        slots = [i % k for i in range(args.batch)] if k else []
        rounds[label] = kernels[kernel](stacks, slots) if kernel else None
    return cases, rounds


def _rates(model, cases: list, rounds: dict, args) -> tuple[dict, dict]:
    """Every case's decode round, each warmed once, then the cases in turn
    `--repeats` times: (label -> tokens/s by wall time per repeat, label ->
    tokens/s by this process's CPU time)."""
    import torch

    ids, meta, cache, rows = decode_round(model, args.batch, args.context)

    def timed(rnd) -> tuple[float, float]:
        """A round's wall time and the process's CPU time, each averaged."""
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.rounds):
            model.forward(ids, meta, cache, rows, lora=rnd)
        if args.device != "cpu":
            torch.cuda.synchronize()
        return ((time.perf_counter() - t0) / args.rounds,
                (time.process_time() - c0) / args.rounds)

    for rnd in rounds.values():                # warm every path
        timed(rnd)
    rates: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    cpu_rates: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    for _ in range(args.repeats):
        for label, _, _ in cases:
            wall, cpu = timed(rounds[label])
            rates[label].append(args.batch / wall)
            cpu_rates[label].append(args.batch / cpu)
    return rates, cpu_rates


def _table(clock: str, rates: dict[str, list[float]], width: int) -> None:
    """tok/s by `clock`: median and spread over the repeats, and against the
    base: median against median, fastest against fastest."""
    base, base_best = statistics.median(rates["base"]), max(rates["base"])
    print(f"{'case':<{width}} {f'tok/s by {clock}':>17} {'min..max':>17} {'vs base':>8} "
          f"{'best vs best':>13}")
    for label, r in rates.items():
        med = statistics.median(r)
        print(f"{label:<{width}} {med:>17.1f} {f'{min(r):.1f}..{max(r):.1f}':>17} "
              f"{med / base:>7.2f}x {max(r) / base_best:>12.2f}x")


def _lora_alone(model, stacks, rounds, cases, args, width) -> None:
    """The LoRA part of a decode round by itself: each case's adds into
    every layer's four fused matmuls, on random rows of the right widths;
    the fastest of 5 x `--repeats` tries, cases interleaved."""
    import torch

    from pdserve.kernels.lora.batched import GROUPS
    from pdserve.kernels.lora.adapter import module_shape

    cfg, dev = model.cfg, model.device
    shapes = [(module_shape(cfg, mods[0])[1], sum(module_shape(cfg, m)[0] for m in mods))
              for mods in GROUPS]
    g = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(args.batch, i, generator=g, device=dev) for i, _ in shapes]
    ys = [torch.zeros(args.batch, o, device=dev) for _, o in shapes]

    @torch.inference_mode()
    def once(rnd) -> float:
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(cfg.num_layers):
            for group in range(len(GROUPS)):
                rnd.add(layer, group, xs[group], ys[group])
        if args.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    best = {label: float("inf") for label, k, _ in cases if k}
    for _ in range(5 * args.repeats):
        for label in best:
            best[label] = min(best[label], once(rounds[label]))
    print(f"LoRA work alone, {cfg.num_layers} layers x 4 fused matmuls, {args.batch} rows "
          f"(fastest of {5 * args.repeats}):")
    for label, ms in best.items():
        print(f"{label:<{width}} {1e3 * ms:>9.2f} ms")
