"""`pdserve bench gpu`: the engine's forward on a GPU beside the card's own
limits, measured in the same run, and beside a peer on the same card.

The limits: the copy bandwidth (a device-to-device copy of `--copy-mib`,
bytes read plus bytes written over its time) and the matmul peak (a
square `--matmul` product in the model's dtype). Each model is a shape
with seeded random weights drawn on the device (benchmarks/common/shapes.py;
nothing downloaded), its attention what an engine picks (flashinfer on a
GPU in half precision), its decode step captured as an engine captures it
at load (CUDA graphs; `--capture off` times the eager step; a MoE whose
experts loop runs eagerly, as an engine runs it). Then:

- decode: a round of `batch` rows, each the next token after `--context`
  tokens of history, for each of `--batches`; its median time against the
  roofline, the time the bytes it must read (every layer's weights and
  the head, and each row's K/V) take at the copy bandwidth, or the time
  its multiplies take at the matmul peak when that is longer;
- prefill: one prompt of each of `--prompts` tokens, in chunks of at most
  `--chunk` rows as the engine schedules it: tokens/s, and the FLOP/s its
  multiplies reach as a fraction of the matmul peak;
- the capture's seconds at load and the device memory its graphs keep;
- a peer (`--peer transformers`): Hugging Face's model of the same shape
  and weights, `generate` with a static cache (which compiles its decode
  step on a GPU), its time per decode step at `--peer-batches`.

`--dry-run` runs every step on this machine's CPU with the `tiny` shape
(torch's attention, the capture's buffers run eagerly): the arithmetic
and the tables, not the figures.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pdserve.benchmarks.common.decode_inputs import decode_meta
from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.shapes import SHAPES, build, model_config
from pdserve.benchmarks.common.timing import median_ms

PAGE = 16
LLAMAS = [s for s in SHAPES if "arch" not in SHAPES[s]]   # the shapes the peer builds


def add_arguments(p) -> None:
    p.add_argument("--models", nargs="+", choices=list(SHAPES),
                   help="model shapes, random weights (llama-3-8b smollm2-135m "
                        "qwen3-30b-a3b-12l; --dry-run: tiny tiny-moe)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                   help="the weights' and the cache's dtype (bfloat16)")
    p.add_argument("--batches", type=positive, nargs="+",
                   help="decode rows a round (1 8 32 64 128 256; --dry-run: 1 4)")
    p.add_argument("--context", type=positive,
                   help="tokens of history per decode row (1024; --dry-run: 48)")
    p.add_argument("--prompts", type=positive, nargs="+",
                   help="prefill prompt lengths (1024 8192; --dry-run: 32 96)")
    p.add_argument("--chunk", type=positive, default=8192,
                   help="the most prompt rows a round, engine.max_scheduled_tokens (8192)")
    p.add_argument("--capture", choices=["auto", "off"], default="auto",
                   help="decode captured as at load (auto) or eager (off)")
    p.add_argument("--peer", choices=["transformers", "none"], default="transformers",
                   help="the peer on the same shape and weights (transformers)")
    p.add_argument("--peer-batches", type=positive, nargs="+", default=[1, 8],
                   help="the peer's decode batches (1 8)")
    p.add_argument("--peer-models", nargs="+", choices=LLAMAS,
                   help="the Llama shapes the peer runs (the first of --models): its compile "
                        "takes a minute or two a batch on a GPU")
    p.add_argument("--rounds", type=positive, default=20, help="timed calls a figure (20)")
    p.add_argument("--copy-mib", type=positive, default=2048,
                   help="the copy that measures the bandwidth, MiB (2048)")
    p.add_argument("--matmul", type=positive, default=8192,
                   help="the square product that measures the matmul peak (8192)")
    p.add_argument("--device", default="cuda", help="the device (cuda)")
    p.add_argument("--dry-run", action="store_true",
                   help="every step on CPU with the tiny shape: the arithmetic, not figures")


@dataclass
class Limits:
    bandwidth: float      # bytes/s a device-to-device copy moves (read + written)
    flops: float          # FLOP/s of a square matmul in the model's dtype


@dataclass
class Footprint:
    """What one decode or prefill round of a model must move and compute.
    A mixture-of-experts model (all its layers sparse) reads, besides its
    other weights, each expert some row of the round chose: with a round's
    rows routed at random, E (1 - (1 - k/E)^rows) of its E experts a layer."""
    weight_bytes: int     # every layer's weights and the head, read once a round (no experts)
    kv_bytes_per_token: int
    matmul_params: int    # the multiplies' weights a row runs (k experts of a sparse layer)
    attn_width: int       # num_heads * head_dim * num_layers
    expert_bytes: int = 0  # one expert's weights, summed over the layers
    experts: int = 0       # E (0: dense)
    top_k: int = 0

    @classmethod
    def of(cls, cfg, elt: int) -> "Footprint":
        h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        head = cfg.vocab_size * h
        attn = h * (q + 2 * kv) + q * h + 2 * h
        moe = cfg.moe
        if moe is None:
            layer = attn + 3 * h * cfg.intermediate_size
            params = cfg.num_layers * layer + head + h
            return cls(params * elt, cfg.num_layers * 2 * kv * elt,
                       cfg.num_layers * (layer - 2 * h) + head, q * cfg.num_layers)
        assert len(moe.sparse_layers) == cfg.num_layers, "a shape with dense MLP layers"
        expert = 3 * h * moe.intermediate
        layer = attn + 2 * cfg.head_dim + moe.num_experts * h   # q/k norms, the router
        active = cfg.num_layers * (layer - 2 * h - 2 * cfg.head_dim + moe.top_k * expert) + head
        return cls((cfg.num_layers * layer + head + h) * elt, cfg.num_layers * 2 * kv * elt,
                   active, q * cfg.num_layers, cfg.num_layers * expert * elt,
                   moe.num_experts, moe.top_k)

    @property
    def total_bytes(self) -> int:
        """Every weight the model holds, each expert included."""
        return self.weight_bytes + self.experts * self.expert_bytes

    def experts_read(self, rows: int) -> float:
        """Bytes of experts a round of `rows` reads, routed at random."""
        if not self.experts:
            return 0.0
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** rows)
        return touched * self.expert_bytes

    def decode_roofline_s(self, batch: int, context: int, lim: Limits) -> tuple[float, str]:
        """(seconds, what bounds it) for `batch` rows over `context` keys each."""
        read = self.weight_bytes + self.experts_read(batch) + \
            batch * (context + 1) * self.kv_bytes_per_token
        flop = 2 * batch * self.matmul_params + 4 * batch * (context + 1) * self.attn_width
        memory, compute = read / lim.bandwidth, flop / lim.flops
        return (memory, "memory") if memory >= compute else (compute, "compute")

    def prefill_flop(self, prompt: int) -> float:
        """The multiplies of one prompt: every row through the weights, and
        causal attention (each row's scores and sum over the keys before it)."""
        return 2 * prompt * self.matmul_params + 2 * prompt * (prompt + 1) * self.attn_width


def measure_limits(dev, dtype, copy_mib: int, n: int, rounds: int) -> Limits:
    import torch

    sync = _sync(dev)
    src = torch.empty(copy_mib << 20, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    copy_s = median_ms(lambda: dst.copy_(src), rounds, sync) / 1e3
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    mm_s = median_ms(lambda: torch.mm(a, b), rounds, sync) / 1e3
    del src, dst, a, b
    return Limits(2 * (copy_mib << 20) / copy_s, 2 * n ** 3 / mm_s)


def _sync(dev):
    import torch

    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def run(args) -> int:
    from pdserve.kernels.models.loader import check_device

    if args.dry_run:
        args.device = "cpu"
    dev = check_device(args.device)     # first: a clear one-line error, nothing built
    _defaults(args)
    import torch

    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (dry run)"
    lim = measure_limits(dev, dtype, args.copy_mib, args.matmul, args.rounds)
    print(f"pdserve bench gpu on {name}, torch {torch.__version__}, {args.dtype}")
    print(f"limits measured: copy {lim.bandwidth / 1e9:.1f} GB/s ({args.copy_mib} MiB device "
          f"to device, read + written), matmul {lim.flops / 1e12:.2f} TFLOP/s "
          f"({args.matmul}^3)")
    ours, peers = {}, []
    dense = [m for m in args.models if m in LLAMAS]
    for shape in dense:                 # each model's tables as soon as it is measured
        load, decodes, prefills, ours[shape] = _one_model(args, shape, dev, lim)
        _print_model(args, load, decodes, prefills)
    for shape in args.peer_models:      # then the peer: its compile is the slowest part
        peers += _peer(args, shape, dev, ours.get(shape, {}))
    _print_peers(peers)
    for shape in [m for m in args.models if m not in dense]:    # the MoE last (issue 56)
        _print_model(args, *_one_model(args, shape, dev, lim)[:3])
    return 0


def _defaults(args) -> None:
    dry = args.dry_run
    if dry:
        args.copy_mib, args.matmul = min(args.copy_mib, 64), min(args.matmul, 256)
    args.models = args.models or (["tiny", "tiny-moe"] if dry else
                                  ["llama-3-8b", "smollm2-135m", "qwen3-30b-a3b-12l"])
    args.peer_models = args.peer_models or [m for m in args.models if m in LLAMAS][:1]
    args.batches = args.batches or ([1, 4] if dry else [1, 8, 32, 64, 128, 256])
    args.context = args.context or (48 if dry else 1024)
    args.prompts = args.prompts or ([32, 96] if dry else [1024, 8192])
    if dry:
        args.chunk = min(args.chunk, 64)


def _one_model(args, shape: str, dev, lim: Limits) -> tuple:
    """Load `shape` as an engine would, time its decode rounds and its
    prefills: (its load row, decode rows, prefill rows, its decode ms by
    batch for the peer's table)."""
    import torch

    model = build(shape, args.dtype, dev, "torch" if args.dry_run else "auto")
    cfg = model.cfg
    fp = Footprint.of(cfg, torch.finfo(getattr(torch, args.dtype)).bits // 8)
    per = -(-(args.context + 1) // PAGE)
    longest = max(args.prompts)
    pages = max(max(args.batches) * per, -(-longest // PAGE))
    caches = model.new_caches([pages + 1], PAGE)          # the last page: the scratch
    cap, seconds, kept = _captured(args, model, caches, per, dev)
    decodes, ms_at = [], {}
    for b in args.batches:
        ms, spread, eager = _decode_ms(args, model, cap, caches, b, dev)
        roof, bound = fp.decode_roofline_s(b, args.context, lim)
        decodes.append((shape, b, ms, spread, eager, roof * 1e3, bound, b / ms * 1e3))
        ms_at[b] = ms
    prefills = [(shape, p, *_prefill(args, model, caches, p, dev, fp, lim))
                for p in args.prompts]
    load = (shape, model.attention.name, fp.total_bytes, seconds, cap.steps if cap else 0,
            kept)
    del cap, caches, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return load, decodes, prefills, ms_at


def _captured(args, model, caches, per: int, dev) -> tuple:
    """The decode step captured as at load (None under --capture off):
    (capture, its seconds, the device memory it keeps)."""
    import torch

    from pdserve.kernels.capture import CaptureMode, DecodeCapture, choose_capture

    if args.capture == "off" or (model.cfg.moe is not None and  # as an engine would
                                 choose_capture("auto", model)[0] is CaptureMode.OFF):
        return None, 0.0, 0
    mode = CaptureMode.CUDA_GRAPH if dev.type == "cuda" else CaptureMode.STATIC
    reserved = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    cap = DecodeCapture(model, caches, mode, max_batch=max(args.batches), max_pages=per,
                        windows=[None])
    seconds = cap.capture()
    kept = torch.cuda.memory_reserved(dev) - reserved if dev.type == "cuda" else 0
    return cap, seconds, kept


def _decode_ms(args, model, cap, caches, b: int, dev) -> tuple:
    """(median ms of the step the engine runs, the spread of three turns'
    medians, the eager step's median ms)."""
    import torch

    from pdserve.kernels.attention import BatchMeta

    ids, meta = decode_meta(b, args.context, PAGE, dev)
    rows = torch.arange(b, device=dev)

    def eager():
        fresh = BatchMeta(meta.seqs, meta.slot_mapping, meta.positions, meta.num_decodes)
        return model.forward(ids, [fresh], caches, rows)
    step = (lambda: cap.run(ids, [meta])) if cap is not None else eager
    step()
    sync = _sync(dev)
    turns = [median_ms(step, args.rounds, sync) for _ in range(3)]
    eager_ms = median_ms(eager, args.rounds, sync) if cap is not None else statistics.median(turns)
    return (statistics.median(turns), f"{min(turns):.2f}-{max(turns):.2f}", eager_ms)


def _prefill(args, model, caches, prompt: int, dev, fp: Footprint, lim: Limits) -> tuple:
    """One prompt of `prompt` tokens in chunks of --chunk rows: (ms,
    tokens/s, TFLOP/s, the fraction of the matmul peak)."""
    import torch

    from pdserve.kernels.attention import BatchMeta, SeqMeta

    table = list(range(-(-prompt // PAGE)))
    chunks = []
    for lo in range(0, prompt, args.chunk):
        n = min(args.chunk, prompt - lo)
        pos = torch.arange(lo, lo + n, device=dev)
        slots = torch.tensor(table, device=dev)[pos // PAGE] * PAGE + pos % PAGE
        chunks.append((torch.randint(0, model.cfg.vocab_size, (n,), device=dev),
                       SeqMeta(0, n, lo + n, table), slots, pos))

    def whole():
        for ids, seq, slots, pos in chunks:
            model.forward(ids, [BatchMeta([seq], slots, pos)], caches,
                          torch.tensor([seq.q_len - 1], device=dev))
    whole()
    ms = median_ms(whole, max(3, args.rounds // 4), _sync(dev))
    flops = fp.prefill_flop(prompt) / (ms / 1e3)
    return ms, prompt / ms * 1e3, flops / 1e12, flops / lim.flops


def _peer(args, shape: str, dev, ours: dict) -> list:
    """Hugging Face's model of `shape` with the same weights: its ms per
    decode step at each --peer-batches, beside ours at that batch (None:
    not measured here)."""
    if args.peer == "none":
        return []
    try:
        hf, version = _hf_model(shape, args.dtype, dev)
    except ImportError as e:
        print(f"peer transformers: not installed here ({e}); skipped")
        return []
    rows = []
    for b in args.peer_batches:
        rows.append((shape, b, ours.get(b), _hf_step_ms(hf, b, args.context, dev), version))
    del hf
    return rows


def _hf_model(shape: str, dtype: str, dev):
    import torch
    import transformers

    from pdserve.kernels.models.model import random_weights

    cfg = model_config(shape)
    conf = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=cfg.tie_word_embeddings)
    rope = getattr(conf, "rope_parameters", None)
    if isinstance(rope, dict):                   # transformers 5
        rope["rope_theta"] = cfg.rope_theta
    else:
        conf.rope_theta = cfg.rope_theta
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(conf)
    weights = random_weights(cfg, 0, getattr(torch, dtype), dev)
    if cfg.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    hf.load_state_dict(weights, assign=True)
    with torch.device(dev):                  # its rotary tables are buffers, not weights
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=conf)
    return hf.eval(), transformers.__version__


def _hf_step_ms(hf, batch: int, context: int, dev) -> float:
    """generate() with a static cache (its decode step compiled on a GPU)
    for `short` and `long` new tokens after a `context`-token prompt: the
    difference over the difference, the prompt's prefill cancelled out."""
    import time

    import torch

    ids = torch.randint(0, hf.config.vocab_size, (batch, context), device=dev)
    short, long = 8, 40

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    cache_implementation="static", pad_token_id=0)
        _sync(dev)()
        return time.perf_counter() - t0
    gen(long)                                # compiles (on a GPU) and warms
    a = statistics.median(gen(short) for _ in range(3))
    b = statistics.median(gen(long) for _ in range(3))
    return (b - a) / (long - short) * 1e3


def _print_model(args, load, decodes, prefills) -> None:
    shape, attention, wbytes, seconds, steps, kept = load
    print(f"\n{shape}: load")
    print("| model | attention | weights GiB | capture s | graphs | capture memory MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    print(f"| {shape} | {attention} | {wbytes / 2**30:.2f} | {seconds:.1f} | {steps} | "
          f"{kept / 2**20:.0f} |")
    print(f"\ndecode, {args.context} tokens of history a row (roofline: the bytes a step "
          "reads at the copy bandwidth, or its multiplies at the matmul peak):")
    print("| model | batch | step ms (turns) | eager ms | roofline ms | bound | "
          "of roofline | tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for shape, b, ms, spread, eager, roof, bound, tps in decodes:
        print(f"| {shape} | {b} | {ms:.3f} ({spread}) | {eager:.3f} | {roof:.3f} | {bound} | "
              f"{roof / ms:.0%} | {tps:.0f} |")
    print(f"\nprefill, chunks of at most {args.chunk} rows:")
    print("| model | prompt | ms | tok/s | TFLOP/s | of matmul peak |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for shape, p, ms, tps, tflops, frac in prefills:
        print(f"| {shape} | {p} | {ms:.2f} | {tps:.0f} | {tflops:.2f} | {frac:.0%} |")


def _print_peers(peers) -> None:
    if peers:
        print("\npeer: transformers generate, static cache (compiled on a GPU), ms a "
              "decode step:")
        print("| model | batch | pdserve ms | transformers ms | transformers / pdserve |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for shape, b, ours, theirs, version in peers:
            mine = f"{ours:.3f}" if ours is not None else "-"
            ratio = f"{theirs / ours:.2f}x" if ours else "-"
            print(f"| {shape} | {b} | {mine} | {theirs:.3f} (transformers {version}) | "
                  f"{ratio} |")
