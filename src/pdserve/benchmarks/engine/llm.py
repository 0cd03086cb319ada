"""`pdserve.LLM` against Hugging Face `generate`, same weights, same prompts,
side by side in one process on the same torch threads, greedy.

Two workloads at each batch size B:
- uniform: B prompts of 64 tokens, 64 new tokens each (EOS ignored). Every
  row is busy to the end, HF's best case.
- trace: the first max(2B, 16) requests of the Azure LLM conversation trace,
  prompt and output lengths divided by `scale` (8: CPU-sized, the shape of
  the distribution kept). pdserve runs them all with max_batch_size B
  (continuous batching: a finished request's slot is refilled next round);
  HF runs them B at a time in trace order, as `generate` does, each batch
  left-padded to its longest prompt and generating until its longest output.

Tokens/s counts the tokens each request asked for (HF's tokens past a
request's own length are waste, not output) over wall time, prefill
included. Before each row both sides run one warm-up batch of the row's
shape (its first B prompt and output lengths) on other prompts, so no timed
request reuses a warmed prefix. Needs transformers (the test extra).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import tempfile
import time
from pathlib import Path

from pdserve.benchmarks.common.options import positive

SIZES = {
    # the tiny preset's shape
    "tiny": dict(vocab_size=98, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~110M parameters
    "llama-110m": dict(vocab_size=16000, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
}


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# Warm-up prompts draw from seeds no timed row uses (below 2**32: torch's CPU
# generator keeps only a seed's low 32 bits, so 2**32 + s would repeat seed s)
WARM_SEED = 1 << 30


def workload(kind: str, batch: int, vocab: int, trace: Path, scale: int, warm: bool = False):
    """[(prompt ids, new tokens)] for one row of the table; with `warm`, one
    batch of the row's shape (its first `batch` lengths) on other prompts,
    which warms both sides up before the row is timed."""
    import torch

    # seeded by workload too: no prompt shares a prefix with another row's
    g = torch.Generator().manual_seed(3 * batch + ("uniform", "trace").index(kind) +
                                      (WARM_SEED if warm else 0))
    if kind == "uniform":
        lens = [(64, 64)] * batch
    else:
        from pdserve.benchmarks.common.traces import AZURE_CONV, trace_file
        from pdserve.sim.trace import read_trace

        reqs = read_trace(trace_file(trace, AZURE_CONV), limit=max(2 * batch, 16))
        lens = [(max(1, r.prompt.length // scale), max(1, r.max_new_tokens // scale))  # type: ignore[attr-defined, operator]
                for r in reqs]
    if warm:
        lens = lens[:batch]
    return [(torch.randint(3, vocab, (p,), generator=g).tolist(), n) for p, n in lens]


def run_ours(llm, reqs) -> tuple[float, list]:
    from pdserve.text.sampling_params import SamplingParams

    sps = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], sps, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert all(len(o.token_ids) == n for o, (_, n) in zip(outs, reqs))
    return wall, [o.token_ids for o in outs]


def run_hf(hf, reqs, batch: int) -> tuple[float, list]:
    """Static batches of `batch` in order, left-padded, each run to its
    longest output; every row then cut to its own length."""
    import torch

    got = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            chunk = reqs[i:i + batch]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(chunk):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            new = max(n for _, n in chunk)
            ids, mask = ids.to(hf.device), mask.to(hf.device)
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
            got += [out[row, width:width + n].tolist() for row, (_, n) in enumerate(chunk)]
    return time.perf_counter() - t0, got


def main(batches=(1, 8, 32), sizes=tuple(SIZES), dtypes=("float32", "bfloat16"),
         workloads=("uniform", "trace"), trace: Path | None = None, scale: int = 8,
         device: str = "cpu", captures=("auto",)) -> int:
    """`device="cuda"`: both sides on the GPU (pdserve with the attention its
    config picks: flashinfer for bfloat16 where installed). `captures`:
    engine.capture settings, each its own rows (the step column says what
    the engine ran: eager, or the captured step's mode)."""
    from pdserve.kernels.models.loader import check_device

    dev = check_device(device)          # first: a clear one-line error, nothing built
    import torch
    import transformers

    from pdserve.llm import LLM

    transformers.utils.logging.disable_progress_bar()     # no "Writing model shards" bars

    rows = []
    for name in sizes:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(**SIZES[name], max_position_embeddings=4096,  # type: ignore[arg-type]
                                       tie_word_embeddings=False)
        base = transformers.LlamaForCausalLM(cfg).float().eval()
        with tempfile.TemporaryDirectory() as d:
            base.save_pretrained(d, safe_serialization=True)
            for dtype in dtypes:
                hf = copy.deepcopy(base).to(dtype=getattr(torch, dtype), device=dev)
                for b, capture in itertools.product(batches, captures):
                    llm = LLM({"model": {"path": d, "dtype": dtype},
                               "engine": {"page_size": 16, "total_pages": 8192,
                                          "max_scheduled_tokens": 4096, "max_batch_size": b,
                                          "capture": capture}},
                              device=device)
                    cap = llm.executor.capture
                    step = cap.mode.value if cap is not None else "eager"
                    for kind in workloads:
                        warm = workload(kind, b, SIZES[name]["vocab_size"], trace, scale,  # type: ignore[arg-type]
                                        warm=True)
                        run_ours(llm, warm)         # this shape's first-run costs untimed
                        run_hf(hf, warm, b)
                        reqs = workload(kind, b, SIZES[name]["vocab_size"], trace, scale)  # type: ignore[arg-type]
                        ours, a = run_ours(llm, reqs)
                        theirs, h = run_hf(hf, reqs, b)
                        tokens = sum(n for _, n in reqs)
                        same = sum(x == y for x, y in zip(a, h))
                        rows.append((name, _params(base), dtype, step, kind, b, len(reqs),
                                     tokens / ours, tokens / theirs, same))
    where = f"CUDA ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "CPU"
    print(f"greedy; uniform: 64-token prompts, 64 new tokens; trace: Azure conversation "
          f"lengths / {scale}; {torch.get_num_threads()} torch threads, {where}")
    print(f"{'model':<11} {'params':>7} {'dtype':>8} {'step':>10} {'workload':>8} {'batch':>5} "
          f"{'reqs':>4} {'pdserve tok/s':>14} {'HF tok/s':>9} {'speedup':>8} {'same':>7}")
    for name, n, dtype, step, kind, b, nreq, a, h, same in rows:
        print(f"{name:<11} {n / 1e6:>6.1f}M {dtype:>8} {step:>10} {kind:>8} {b:>5} {nreq:>4} "
              f"{a:>14.1f} {h:>9.1f} {a / h:>7.2f}x {same:>3}/{nreq:<3}")
    print("same: requests whose tokens equal HF's exactly; float32 should match every one, "
          "bfloat16 drifts (8-bit mantissa, different kernel order)")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", choices=list(SIZES),
                   help="model shapes, random weights built on the spot, nothing downloaded "
                        "(default both)")
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"],
                   help="dtypes, each run by both sides (default both)")
    p.add_argument("--workload", nargs="+", choices=["uniform", "trace"],
                   help="uniform lengths and/or the trace's (default both)")
    p.add_argument("--batches", type=positive, nargs="+", help="batch sizes (default 1 8 32)")
    p.add_argument("--trace", help="the lengths of the trace workload (default the Azure "
                                   "conversation trace in ../shared/data/traces)")
    p.add_argument("--scale", type=positive,
                   help="divide the trace's lengths by this (default 8)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--capture", nargs="+", choices=["auto", "off", "on"],
                   help="engine.capture settings, each its own rows (default auto)")


def run(args) -> int:
    kw = {k: v for k, v in (("sizes", args.models), ("dtypes", args.dtype),
                            ("workloads", args.workload), ("batches", args.batches),
                            ("trace", args.trace), ("scale", args.scale),
                            ("captures", args.capture)) if v}
    return main(**kw, device=args.device)
