"""`pdserve bench quantized`: a GGUF's decode round with its weights kept
quantized (kernels/cpu/quantized.py, what `model.quantization: auto` runs on
CPU), through pdserve's own kernels (auto's choice where they build: the
decode rows' layers in one C call each, kernels/cpu/layer.py, or
only its matmul and attention between torch's operators) and through
torch's, in float32 and bfloat16 models,
against the same file dequantized to float32 and to bfloat16, side by side
in one process.

Each case is the same file (SmolLM2-135M Q4_1 by default) loaded its way.
A decode round of `--batch` sequences, each `--context` tokens into its
history, runs through the model's forward (every layer, attention over
the paged cache, the logits); the cases take turns, `--rounds` forwards a
turn, `--repeats` turns. The table gives the median round's wall time and
this process's CPU time a round (the figure a shared host disturbs less),
their spread, and each against float32 dequantized of the same turns.
Decode rows always go through the kernels (only prefill rows take the
dense copy), so the rows show where the kernels stop paying.

Then what the quantized weights change in the answers: one prompt of real
text fed to every case a token a round, as decode rows (the path a served
token takes), its logits at every position against float32 dequantized
prefilled (the file's values in full precision): the share of positions
whose top token agrees, and the largest logit difference. bfloat16 is the
yardstick: its rounding is what `auto` accepts on a bfloat16 CPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from pdserve.benchmarks.common.decode_inputs import decode_round
from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.tables import median_range

# (label, dtype, quantization, kernels: PDSERVE_CPU_KERNELS while it loads,
# or "ops": pdserve's matmul and attention without its decode layer)
CASES = (("float32", "float32", "none", "auto"), ("bfloat16", "bfloat16", "none", "auto"),
         ("quantized float32, pdserve layer", "float32", "gguf", "native"),
         ("quantized float32, torch kernels", "float32", "gguf", "torch"),
         ("quantized bfloat16, pdserve layer", "bfloat16", "gguf", "native"),
         ("quantized bfloat16, pdserve ops", "bfloat16", "gguf", "ops"),
         ("quantized bfloat16, torch kernels", "bfloat16", "gguf", "torch"))
TEXT = ("The river ran through the old town, past the mill and under three stone bridges. "
        "In spring the water rose to the arches, and children dropped sticks from one side "
        "to watch them float out on the other. The miller kept a ledger of every flood since "
        "his grandfather's time: the year, the height against a mark on the wall, and what "
        "was lost. Most years it was nothing but a few sacks of flour. Once it was the whole "
        "lower floor, and the family lived upstairs until the summer dried the boards. ")


def add_arguments(p) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="a GGUF preset (smollm2-135m)")
    p.add_argument("--batches", default="1,8,32",
                   help="decode rows a round, comma-separated (1,8,32)")
    p.add_argument("--context", type=positive, default=256, help="history per row (256)")
    p.add_argument("--rounds", type=positive, default=10, help="forwards a turn (10)")
    p.add_argument("--repeats", type=positive, default=5, help="turns per case (5)")
    p.add_argument("--threads", type=positive, default=None,
                   help="torch threads (default: torch's)")


def prefill_logits(model, ids: list[int], page: int = 16):
    """float32 logits at every position of one prompt, prefilled at once."""
    import torch

    from pdserve.kernels.attention import BatchMeta, SeqMeta

    n = len(ids)
    pages = -(-n // page)
    cache = model.new_cache(pages, page)
    meta = BatchMeta([SeqMeta(0, n, n, list(range(pages)))], torch.arange(n), torch.arange(n))
    return model.forward(torch.tensor(ids), meta, cache, torch.arange(n)).float()


def decode_logits(model, ids: list[int], page: int = 16):
    """float32 logits at every position of one prompt fed a token a round
    as decode rows (teacher-forced): the path a served token takes."""
    import torch

    from pdserve.kernels.attention import BatchMeta, SeqMeta

    table = list(range(-(-len(ids) // page)))
    cache = model.new_cache(len(table), page)
    out = []
    for t, tok in enumerate(ids):
        meta = BatchMeta([SeqMeta(0, 1, t + 1, table)], torch.tensor([t]), torch.tensor([t]),
                         num_decodes=1)
        out.append(model.forward(torch.tensor([tok]), meta, cache, torch.tensor([0]))[0])
    return torch.stack(out).float()


def run(args) -> int:
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    models, loads, tok = _load_cases(args.preset)
    print(f"{args.preset} on cpu, torch attention, {torch.get_num_threads()} torch threads; "
          f"a decode round of B rows at {args.context} tokens of history, {args.rounds} "
          f"rounds a turn, {args.repeats} turns a case, cases interleaved")
    print("| batch | case | wall ms/round (min-max) | vs float32 | CPU ms/round (min-max) "
          "| vs float32 |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for b in batches:
        wall, cpu = _decode_turns(models, b, args)
        bw, bc = statistics.median(wall["float32"]), statistics.median(cpu["float32"])
        for label in models:
            w, c = wall[label], cpu[label]
            print(f"| {b} | {label} | {median_range(w)} | {statistics.median(w) / bw:.2f}x | "
                  f"{median_range(c)} | {statistics.median(c) / bc:.2f}x |")
    ids = tok.encode(TEXT)
    truth = prefill_logits(models["float32"], ids)
    print(f"\nagainst float32 dequantized, {len(ids)} positions of one prompt:")
    print("| case | top token agrees | largest logit difference | load s |")
    print("| --- | ---: | ---: | ---: |")
    for label, m in models.items():
        lg = decode_logits(m, ids)
        agree = (lg.argmax(-1) == truth.argmax(-1)).float().mean().item()
        print(f"| {label} | {100 * agree:.1f}% | {(lg - truth).abs().max().item():.2f} | "
              f"{loads[label]:.1f} |")
    return 0


def _load_cases(preset: str) -> tuple[dict, dict, Any]:
    """Every case of CASES that runs here, loaded its way (the kernels env
    var set while it loads, then restored): (label -> model, label -> load
    seconds, the tokenizer)."""
    import os

    from pdserve.kernels.cpu.native import KERNELS_ENV, native_kernels
    from pdserve.kernels.models.loader import load_model

    models, loads = {}, {}
    tok = None
    native = native_kernels()
    if native.lib is None:
        print(f"(no pdserve kernels here: {native.why})")
    before = os.environ.get(KERNELS_ENV)
    try:
        for label, dtype, quant, kernels in CASES:
            if kernels in ("native", "ops") and native.lib is None:
                continue
            os.environ[KERNELS_ENV] = "native" if kernels == "ops" else kernels
            t0 = time.perf_counter()
            models[label], tok = load_model(None, preset, dtype=dtype, attention="torch",
                                            quantization=quant)
            loads[label] = time.perf_counter() - t0
            if kernels == "ops":
                models[label].native_layers = None
    finally:
        if before is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = before
    assert tok is not None
    return models, loads, tok


def _decode_turns(models: dict, batch: int, args) -> tuple[dict, dict]:
    """A decode round of `batch` rows through every case in turn, `--rounds`
    a turn, a warm-up turn and then `--repeats`: (label -> wall ms a round
    per turn, label -> this process's CPU ms a round per turn)."""
    inputs = {label: decode_round(m, batch, args.context) for label, m in models.items()}
    wall: dict[str, list[float]] = {label: [] for label in models}
    cpu: dict[str, list[float]] = {label: [] for label in models}
    for turn in range(args.repeats + 1):
        for label, m in models.items():
            ids, meta, cache, rows = inputs[label]
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.rounds):
                m.forward(ids, meta, cache, rows)
            if turn:                                  # the first turn warms up
                wall[label].append((time.perf_counter() - w0) / args.rounds * 1e3)
                cpu[label].append((time.process_time() - c0) / args.rounds * 1e3)
    return wall, cpu
