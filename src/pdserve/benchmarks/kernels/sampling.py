"""`pdserve bench sampling`: what turning a round's logits into tokens
costs, against the sampler as it was before 2026-12-02, side by side.

The rows are real: SmolLM2-135M's logits at every position of an English
text (teacher-forced, one forward), so top-p's nucleus is as wide as a
real model makes it; `--vocab-rows` adds the tiny preset's vocabulary (98
tokens, random logits) that the serving benchmarks run. Each cell times
both samplers alternately on the same rows and reports the median of
`--repeats`; "beyond" is the share of top-p rows whose cut lay beyond the
row's 256 most likely tokens (the first of TOP_P_CANDIDATES: those rows
look again among more).

The baseline (`sample_before` below) is the previous implementation: the
selected rows copied, temperature, top-k and top-p on the logits, a full
sort of every top-p row, and a float64 cumulative sum over each whole row.

A second table times what the penalties, logit bias and min-p add to a t=1
round (`penalties`), every row penalized with a history of random tokens.
"""

from __future__ import annotations

import argparse
import statistics

from pdserve.benchmarks.common.options import positive
from pdserve.benchmarks.common.timing import alternating

KINDS = {
    "greedy": dict(temperature=0),
    "t=1": dict(temperature=1.0),
    "t=0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "t=1 top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "t=0.8 top-k 50": dict(temperature=0.8, top_k=50),
}

# what penalties add to a t=1 row: (kind, params, prompt tokens, output tokens)
PENALTIES = [
    ("frequency + presence", dict(frequency_penalty=0.5, presence_penalty=0.5), 1000, 256),
    ("repetition", dict(repetition_penalty=1.2), 1000, 256),
    ("all three", dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.2),
     1000, 256),
    ("logit_bias, 16 tokens", dict(logit_bias={t: 2.0 for t in range(16)}), 1000, 256),
    ("min_p 0.05", dict(min_p=0.05), 0, 0),
]

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
        "Books became cheaper, literacy spread across Europe, and ideas travelled faster "
        "than ever before. Scholars argue about how much of the change was technical and "
        "how much was social, but few doubt that the press reshaped religion, science and "
        "politics. In the centuries that followed, newspapers, pamphlets and novels found "
        "readers in every town, and the printed page became the ordinary way to learn. ")


def sample_before(logits, params, steps, fallback_seeds):
    """The sampler before 2026-12-02 (no min_tokens masks, no logprobs): the
    baseline the table compares with."""
    import torch

    from pdserve.kernels.sampling import row_uniform

    tokens = logits.argmax(dim=-1)
    rows = [i for i, sp in enumerate(params) if not sp.greedy]
    if rows:
        sps = [params[i] for i in rows]
        seeds = [sp.seed if sp.seed is not None else fallback_seeds[i]
                 for sp, i in zip(sps, rows)]
        draws = [row_uniform(s, steps[i]) for s, i in zip(seeds, rows)]
        vocab, n = logits.shape[-1], len(rows)
        ks = [sp.top_k if 0 < sp.top_k < vocab else 0 for sp in sps]
        by_k = [j for j in range(n) if ks[j]]
        by_p = [j for j in range(n) if sps[j].top_p < 1.0]
        f64 = torch.float64
        temp = torch.tensor([float(sp.temperature) for sp in sps], dtype=f64)
        top_p = torch.tensor([float(sp.top_p) for sp in sps], dtype=f64)
        u = torch.tensor(draws, dtype=f64)
        idx = torch.tensor(rows)
        x = logits.index_select(0, idx) / temp.to(logits.dtype)[:, None]
        if by_k:
            sub = torch.tensor(by_k)
            xs = x.index_select(0, sub)
            kk = torch.tensor([ks[j] for j in by_k])
            kth = xs.topk(max(ks), dim=-1).values.gather(1, kk[:, None] - 1)
            x.index_copy_(0, sub, xs.masked_fill(xs < kth, float("-inf")))
        if by_p:
            sub = torch.tensor(by_p)
            xs = x.index_select(0, sub)
            desc = xs.sort(dim=-1, descending=True, stable=True).values
            p = torch.softmax(desc, dim=-1).double()
            keep = (p.cumsum(-1) - p) < top_p.index_select(0, sub)[:, None]
            cut = desc.gather(1, keep.sum(-1, keepdim=True) - 1)
            x.index_copy_(0, sub, xs.masked_fill(xs < cut, float("-inf")))
        weights = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        cdf = weights.double().cumsum(-1)
        drawn = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).view(-1)
        tokens.index_copy_(0, idx, drawn.clamp_(max=vocab - 1))
    return tokens.tolist()


def real_logits(positions: int):
    """SmolLM2's logits at the first `positions` positions of TEXT (repeated)."""
    import torch

    from pdserve.kernels.attention import BatchMeta, SeqMeta
    from pdserve.kernels.models.loader import load_model

    model, tok = load_model(None, "smollm2-135m", quantization="none")   # dense, as docs/benchmarks.md's tables ran
    ids = tok.encode(TEXT * (1 + positions // 100), add_special_tokens=False)[:positions]
    if len(ids) < positions:
        raise ValueError(f"the text gives {len(ids)} tokens, fewer than {positions}")
    ps = 16
    cache = model.new_caches([-(-positions // ps)], ps)[0]
    table = list(range(-(-positions // ps)))
    meta = BatchMeta([SeqMeta(0, positions, positions, table)],
                     torch.tensor([table[p // ps] * ps + p % ps for p in range(positions)]),
                     torch.arange(positions), window=model.cfg.sliding_window)
    with torch.inference_mode():
        return model.forward(torch.tensor(ids), meta, cache, torch.arange(positions))


def _beyond(logits, sp) -> float | None:
    """Share of rows whose top-p cut lies beyond the first candidates."""
    import torch

    from pdserve.kernels.sampling import TOP_P_CANDIDATES

    k = TOP_P_CANDIDATES[0]
    if sp.top_p >= 1.0 or logits.shape[-1] <= k:
        return None
    p = torch.softmax(logits / sp.temperature, dim=-1)
    return (p.topk(k, dim=-1).values.sum(-1) < sp.top_p).float().mean().item()


def main(batches=(16, 64), repeats: int = 7, threads: int = 1, tiny: bool = True) -> int:
    import torch

    from pdserve.kernels.sampling import sample
    from pdserve.text.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    pool = real_logits(max(batches))
    sets = [("smollm2-135m", pool)]
    if tiny:
        g = torch.Generator().manual_seed(0)
        sets.append(("tiny", torch.randn(max(batches), 98, generator=g) * 3))
    print(f"sampling, {threads} torch thread(s), median of {repeats}, both samplers "
          "alternating on the same rows")
    print("| vocab | batch | kind | before | now | speed-up | beyond |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for name, rows in sets:
        for b in batches:
            logits = rows[:b].contiguous()
            for kind, kw in KINDS.items():
                params = [SamplingParams(seed=i, **kw) for i in range(b)]  # type: ignore[arg-type]
                steps, seeds = list(range(b)), [0] * b
                old = lambda: sample_before(logits, params, steps, seeds)   # noqa: E731
                new = lambda: sample(logits, params, steps, seeds)          # noqa: E731
                before, now = alternating(old, new, repeats)
                t0, t1 = statistics.median(before), statistics.median(now)
                share = _beyond(logits, params[0])
                print(f"| {name} ({logits.shape[-1]:,}) | {b} | {kind} | {_fmt(t0)} | "
                      f"{_fmt(t1)} | {t0 / t1:.1f}x | "
                      f"{'-' if share is None else f'{share:.0%}'} |", flush=True)
    penalties(pool, batches, repeats)
    return 0


def penalties(pool, batches, repeats: int) -> None:
    """What each penalty adds to a t=1 round on SmolLM2's rows, the plain
    and the penalized sampler alternating; every row penalized, with a
    history of the given length (random tokens; the prompt's distinct ones
    as the executor keeps them)."""
    import random

    import numpy as np

    from pdserve.kernels.sampling import sample
    from pdserve.text.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = pool.shape[-1]
    print(f"\npenalties at t=1, SmolLM2 ({vocab:,}), every row penalized, median of {repeats}")
    print("| batch | kind | history (prompt + output) | t=1 | with it | added |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for b in batches:
        logits = pool[:b].contiguous()
        steps, seeds = list(range(b)), [0] * b
        plain = [SamplingParams(seed=i) for i in range(b)]
        for kind, kw, n_prompt, n_out in PENALTIES:
            params = [SamplingParams(seed=i, **kw) for i in range(b)]  # type: ignore[arg-type]
            hist = [(np.unique([rng.randrange(vocab) for _ in range(n_prompt)]),
                     [rng.randrange(vocab) for _ in range(n_out)]) for _ in range(b)]
            base = lambda: sample(logits, plain, steps, seeds)                     # noqa: E731
            pen = lambda: sample(logits, params, steps, seeds, histories=hist)     # noqa: E731
            t0, t1 = alternating(base, pen, repeats)
            a, c = statistics.median(t0), statistics.median(t1)
            print(f"| {b} | {kind} | {n_prompt} + {n_out} | {_fmt(a)} | {_fmt(c)} | "
                  f"{_fmt(max(c - a, 0.0))} |", flush=True)


def _fmt(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=positive, nargs="+", default=[16, 64],
                   help="rows sampled together, one table row each (16 64)")
    p.add_argument("--repeats", type=positive, default=7, help="timings per cell (7)")
    p.add_argument("--threads", type=positive, default=1, help="torch intra-op threads (1)")
    p.add_argument("--no-tiny", action="store_true",
                   help="leave out the tiny preset's 98-token vocabulary")


def run(args) -> int:
    return main(args.batches, args.repeats, args.threads, not args.no_tiny)


if __name__ == "__main__":
    raise SystemExit(main())
