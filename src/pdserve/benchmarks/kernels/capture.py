"""`pdserve bench capture`: the captured decode step (kernels/capture.py)
against the eager one, on the same model, side by side in one process.

Each model is a shape with seeded random weights (nothing downloaded):
`smollm2-135m` is the default model's shape (30 layers, hidden 576, 9
query and 3 KV heads of 64, a 49152-token vocabulary), `llama-110m` the
one `bench llm` uses. `--attention` picks torch's attention, flashinfer's
(CUDA, half precision: its decode wrapper in CUDA-graph mode, planned
before each replay), or both, one after the other.

First the capture as an engine does it at load: every batch bucket up to
`--max-batch-size` times every table-width bucket up to `--max-context`
tokens, recorded (CUDA graphs on a GPU) or compiled (torch.compile on
CPU); its seconds, how many steps, and the device memory they keep.
Then decode rounds of each `--batches` size, every row `--context` tokens
into its history: the eager forward and the captured one take turns,
`--rounds` of each a turn, `--repeats` turns; the table gives each one's
median and the spread of the turns' medians, the ratio, and the largest
logit difference between the two (what the capture must keep under 1e-5
in float32).
"""

from __future__ import annotations

import statistics

from pdserve.benchmarks.common.decode_inputs import decode_meta
from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.shapes import SHAPES, build
from pdserve.benchmarks.common.timing import median_ms

MODES = ("cuda_graph", "compile", "static")
PAGE = 16


def add_arguments(p) -> None:
    p.add_argument("--models", nargs="+", choices=list(SHAPES), default=["smollm2-135m"],
                   help="model shapes, random weights (smollm2-135m)")
    p.add_argument("--dtype", nargs="+", choices=["bfloat16", "float32"],
                   default=["bfloat16", "float32"], help="dtypes (both)")
    p.add_argument("--batches", type=positive, nargs="+", default=[1, 16, 64],
                   help="decode rows a round (1 16 64)")
    p.add_argument("--context", type=positive, default=160,
                   help="tokens of history per row (160: a 128-token prompt, 32 generated)")
    p.add_argument("--max-batch-size", type=positive, default=256,
                   help="the largest batch bucket captured, engine.max_batch_size (256)")
    p.add_argument("--max-context", type=positive, default=8192,
                   help="the widest table captured, in tokens (8192: SmolLM2's context, which "
                        "an engine's max_context_tokens defaults to)")
    p.add_argument("--rounds", type=positive, default=20, help="forwards a turn (20)")
    p.add_argument("--repeats", type=positive, default=3, help="turns (3)")
    p.add_argument("--attention", nargs="+", choices=["torch", "flashinfer"], default=["torch"],
                   help="attention backends (torch); flashinfer runs bfloat16 only")
    p.add_argument("--device", default="cuda", help="cuda (CUDA graphs) or cpu (cuda)")
    p.add_argument("--mode", choices=MODES,
                   help="how the step is captured (default: cuda_graph on a GPU, compile on "
                        "CPU; static runs the captured buffers eagerly)")


def _fresh(meta):
    """The round's metas as the engine builds them each round (nothing
    prepared yet), for the eager forward."""
    from pdserve.kernels.attention import BatchMeta

    return [BatchMeta(meta.seqs, meta.slot_mapping, meta.positions, meta.num_decodes,
                      meta.window)]


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else "-"


def run(args) -> int:
    from pdserve.kernels.models.loader import check_device

    dev = check_device(args.device)     # first: a clear one-line error, nothing built
    if max(args.batches) > args.max_batch_size or args.context + 1 > args.max_context:
        raise SystemExit(f"pdserve bench capture: rounds of up to {max(args.batches)} rows of "
                         f"{args.context + 1} tokens run eagerly past --max-batch-size "
                         f"{args.max_batch_size} and --max-context {args.max_context}; raise "
                         f"those or lower --batches and --context")
    import torch

    from pdserve.kernels.capture import CaptureMode

    if "flashinfer" in args.attention and dev.type != "cuda":
        raise SystemExit("pdserve bench capture: --attention flashinfer needs --device cuda")
    mode = CaptureMode(args.mode or ("cuda_graph" if dev.type == "cuda" else "compile"))
    if mode is CaptureMode.CUDA_GRAPH and dev.type != "cuda":
        raise SystemExit("pdserve bench capture: --mode cuda_graph needs --device cuda")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"decode step captured ({mode.value}) against eager, on {name}, torch "
          f"{torch.__version__}; rows of {args.context} tokens of history, pages of {PAGE}")
    loads, rows = [], []
    for attention in args.attention:
        for shape in args.models:
            for dtype in args.dtype:
                if attention == "flashinfer" and dtype == "float32":
                    print(f"{shape} float32 with flashinfer: skipped (no float32 kernels)")
                    continue
                load, timed = _one_model(args, shape, dtype, dev, mode, attention)
                loads.append(load)
                rows += timed
    _print_tables(args, loads, rows)
    return 0


def _one_model(args, shape: str, dtype: str, dev, mode, attention: str) -> tuple[tuple, list]:
    """`shape` in `dtype` captured as an engine does at load, then each
    batch of `--batches` timed eager and captured: (its load row, its
    rows)."""
    import torch

    from pdserve.kernels.capture import DecodeCapture

    cuda = dev.type == "cuda"
    model = build(shape, dtype, dev, attention)
    per = -(-(args.context + 1) // PAGE)
    pages = max(args.batches) * per
    caches = model.new_caches([pages + 1], PAGE)     # the last page: the scratch
    torch.manual_seed(1)
    for c in caches:
        c.data.normal_()
    cap = DecodeCapture(model, caches, mode, max_batch=args.max_batch_size,
                        max_pages=-(-args.max_context // PAGE), windows=[None])
    kept = torch.cuda.memory_reserved(dev) if cuda else 0
    seconds = cap.capture()
    kept = (torch.cuda.memory_reserved(dev) - kept) if cuda else 0
    rows = [(shape, dtype, attention, b, *_eager_and_captured(args, model, cap, caches, b, dev))
            for b in args.batches]
    load = (shape, dtype, attention, seconds, cap.steps, kept)
    del cap, caches, model
    if cuda:
        torch.cuda.empty_cache()
    return load, rows


def _eager_and_captured(args, model, cap, caches, b: int, dev) -> tuple:
    """A decode round of `b` rows, eager and captured taking turns:
    (eager median, its spread, captured median, its spread, the ratio,
    the largest logit difference)."""
    import torch

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    ids, meta = decode_meta(b, args.context, PAGE, model.device)
    eager_run = lambda: model.forward(ids, _fresh(meta), caches,  # noqa: E731
                                      torch.arange(b, device=dev))
    captured_run = lambda: cap.run(ids, [meta])  # noqa: E731
    got = cap.run(ids, [meta])
    assert got is not None          # the options were checked against the buckets
    diff = (got.float() - eager_run().float()).abs().max().item()
    eager, captured = [], []
    for _ in range(args.repeats):
        eager.append(median_ms(eager_run, args.rounds, sync))
        captured.append(median_ms(captured_run, args.rounds, sync))
    e, c = statistics.median(eager), statistics.median(captured)
    return e, _spread(eager), c, _spread(captured), e / c, diff


def _print_tables(args, loads: list, rows: list) -> None:
    print("\ncapture at load (batch buckets up to", args.max_batch_size, "x table buckets up to",
          args.max_context, "tokens):")
    print("| model | dtype | attention | capture s | steps | device memory kept |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for shape, dtype, attention, seconds, steps, kept in loads:
        print(f"| {shape} | {dtype} | {attention} | {seconds:.1f} | {steps} | "
              f"{kept / 2**20:.0f} MiB |")
    print("\ndecode round, median ms (spread of the turns' medians):")
    print("| model | dtype | attention | batch | eager ms | captured ms | eager / captured | "
          "max |logit diff| |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape, dtype, attention, b, e, es, c, cs, ratio, diff in rows:
        print(f"| {shape} | {dtype} | {attention} | {b} | {e:.2f} ({es}) | {c:.2f} ({cs}) | "
              f"{ratio:.2f}x | {diff:.1e} |")
