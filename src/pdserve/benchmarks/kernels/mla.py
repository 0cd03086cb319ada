"""`pdserve bench mla`: latent attention's two ways, absorbed and expanded
(kernels/models/moe/mla.py), on DeepSeek-V3's attention shape (128 heads,
latent 512, rotary 64, nope 128, v 128) over random latent pages: a decode
batch at several batch sizes and contexts, and a prefill chunk over a
cached context. Each cell times both ways alternately on the same inputs
(median of `--repeats`). The model takes, per sequence, the way with fewer
multiply-adds (`MlaAttention.absorbs`, the last column): decode rows
absorbed, a first chunk expanded, a short chunk over a long context
absorbed."""

from __future__ import annotations

import argparse
import statistics

from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.timing import alternating

DECODES = [(1, 256), (1, 2048), (8, 512), (32, 256), (32, 1024)]       # (batch, context)
PREFILLS = [(512, 0), (128, 2048), (16, 4096)]                          # (chunk, cached before)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--heads", type=positive, default=128,
                   help="query heads (DeepSeek-V3: 128; a TP rank holds 128 / T)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=positive, default=2)


def _setup(heads: int, dtype):
    import torch

    from pdserve.kernels.models.moe.mla import MlaAttention, MlaWeights
    from pdserve.kernels.models.moe.specs import MlaSpec

    torch.manual_seed(0)
    nope, rope, v, lat = 128, 64, 128, 512
    spec = MlaSpec(1536, lat, nope, rope, v, True, (nope + rope) ** -0.5)
    kv_b = torch.randn(heads * (nope + v), lat, dtype=dtype) * 0.02
    per_head = kv_b.view(heads, nope + v, lat)
    empty = torch.empty(0)
    w = MlaWeights(None, None, empty, empty, empty, kv_b, per_head[:, :nope].contiguous(),
                   per_head[:, nope:].contiguous(), empty)
    return MlaAttention(spec, heads), w, spec


def _cell(att, w, spec, rows: int, batch: int, ctx: int, repeats: int, dtype) -> tuple:
    """Seconds (absorbed, expanded) of `batch` sequences of `rows` query
    rows each over `ctx` keys (their own rows last)."""
    import torch

    h = att.h
    q_nope = torch.randn(batch, rows, h, spec.qk_nope_head_dim, dtype=dtype)
    q_pe = torch.randn(batch, rows, h, spec.qk_rope_head_dim, dtype=dtype)
    keys = torch.randn(batch, ctx, spec.cache_width, dtype=dtype)
    qpos = torch.arange(ctx - rows, ctx)
    bias = torch.zeros(rows, ctx).masked_fill_(torch.arange(ctx)[None, :] > qpos[:, None],
                                               float("-inf"))[None, None]
    a, x = alternating(lambda: att._absorbed(q_nope, q_pe, keys, bias, w),
                       lambda: att._expanded(q_nope, q_pe, keys, bias, w), repeats)
    return statistics.median(a), statistics.median(x)


def _way(att, rows: int, keys: int) -> str:
    return "absorbed" if att.absorbs(rows, keys) else "expanded"


def run(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    att, w, spec = _setup(args.heads, dtype)
    print(f"latent attention, {args.heads} heads, latent {spec.kv_lora_rank} + rotary "
          f"{spec.qk_rope_head_dim}, {args.dtype}, {args.threads} threads; median of "
          f"{args.repeats}")
    print(f"{'rows':<28} {'absorbed':>10} {'expanded':>10} {'expanded/absorbed':>18} "
          f"{'model takes':>12}")
    for batch, ctx in DECODES:
        a, x = _cell(att, w, spec, 1, batch, ctx, args.repeats, dtype)
        print(f"{f'decode: {batch} x 1 over {ctx}':<28} {a * 1e3:>8.1f}ms {x * 1e3:>8.1f}ms "
              f"{x / a:>17.2f}x {_way(att, 1, ctx):>12}")
    for chunk, before in PREFILLS:
        a, x = _cell(att, w, spec, chunk, 1, before + chunk, args.repeats, dtype)
        print(f"{f'prefill: {chunk} after {before}':<28} {a * 1e3:>8.1f}ms {x * 1e3:>8.1f}ms "
              f"{x / a:>17.2f}x {_way(att, chunk, before + chunk):>12}")
    return 0
