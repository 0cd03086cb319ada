"""Teacher-forced per-row logits: an attention backend against the torch
reference, every row of every round compared.

Three models share one set of weights (rounded to the dtype under test):
  truth  torch attention in float32: what the dtype's arithmetic approximates
  ref    torch attention in the dtype
  test   the backend under test, in the dtype
Every sequence's tokens are fixed before the runs (a prompt, then the
truth's greedy tokens), so each model sees the same input at every
position, whatever it would have generated itself: a near-tie between two
logits cannot cascade into a different continuation, as it does when
greedy outputs are compared. A row passes when the test backend's logits
are about as close to the truth as the torch reference's own: its largest
error is at most TOL_FACTOR times the reference's 99th-percentile row
error (plus a floor for float32, where ref and truth are the same numbers).

The schedule drives the paths the engine uses: first chunks of 1 row and
of more than 64 rows (where flashinfer's auto would switch from fa2 to fa3
on Hopper), chunks over cached pages, mixed prefill+decode rounds and
decode-only rounds, crossing page boundaries and, with a window, the
sliding window. Block tables are scattered through the pool.

Used by tests/kernels/test_device.py (CUDA, real flashinfer; CPU, the stand-in
tests/support/flashinfer_fake.py) and tools/gpu/per_row_check.py.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from pdserve.kernels.attention import BatchMeta, SeqMeta, TorchAttention
from pdserve.kernels.flashinfer_attention import FlashInferAttention
from pdserve.kernels.models.model import DecoderModel, random_weights
from pdserve.kernels.models.model_config import ModelConfig

PAGE = 16
TOL_FACTOR = 4.0
FLOOR = 1e-4             # times the largest |logit|: float32's allowance

# (name, prefill chunks as (seq, rows), decoding seqs): run in order.
# Sequences A-E; a decode feeds the truth's greedy token back.
PROMPTS = {"A": 150, "B": 100, "C": 40, "D": 90, "E": 20}
SCHEDULE = [
    ("first chunks of 80 and 1 rows", [("A", 80), ("B", 1)], []),
    ("chunks over cached pages, a 99-row one", [("A", 70), ("B", 99), ("C", 40)], []),
    ("mixed: a 70-row first chunk + decodes", [("D", 70)], ["A", "B", "C"]),
    ("mixed: a chunk over cached pages + decodes", [("D", 20)], ["A", "B", "C"]),
    *[(f"decode {i}", [], ["A", "B", "C", "D"]) for i in range(9)],
    ("mixed: a 1-row first chunk + decodes", [("E", 1)], ["A", "B", "C", "D"]),
    ("mixed: 19 rows over a 1-row prefix + decodes", [("E", 19)], ["A", "B", "C", "D"]),
    *[(f"decode all {i}", [], ["A", "B", "C", "D", "E"]) for i in range(3)],
]


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    group: int                      # query heads per KV head
    window: int | None = None
    head_dim: int = 128
    kv_heads: int = 2

    @property
    def name(self) -> str:
        w = f"-window{self.window}" if self.window else ""
        return f"{str(self.dtype).removeprefix('torch.')}-group{self.group}{w}"


def model_config(case: Case) -> ModelConfig:
    return ModelConfig(arch="mistral" if case.window else "llama", vocab_size=256,
                       hidden_size=256, num_layers=2, num_heads=case.kv_heads * case.group,
                       num_kv_heads=case.kv_heads, head_dim=case.head_dim,
                       intermediate_size=512, max_position=1024, sliding_window=case.window)


# the device test's cases: both half-precision dtypes, GQA groups 1-8
# (CUDA-core decode up to 4, tensor cores past it), a sliding window; three
# (dtype, window) pairs, so three flashinfer modules to compile
DEVICE_CASES = [Case(dtype, group, window)
                for dtype, window in ((torch.float16, None), (torch.bfloat16, None),
                                      (torch.bfloat16, 24))
                for group in range(1, 9)]


def write_checkpoint(case: Case, directory) -> None:
    """A Hugging Face-style checkpoint of `case`'s model (config.json and
    model.safetensors, no tokenizer): what LLM(path=...) loads."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    cfg = model_config(case)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}[cfg.arch]
    (d / "config.json").write_text(json.dumps({
        "architectures": [arch], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position,
        "sliding_window": cfg.sliding_window, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": False, "dtype": str(case.dtype).removeprefix("torch.")}))
    save_file({k: v.to(case.dtype).contiguous()
               for k, v in random_weights(cfg, 1234 + case.group).items()},
              str(d / "model.safetensors"))


class WindowOffByOne(FlashInferAttention):
    """A planted bug the check must catch: flashinfer is told the sliding
    window is one key wider than the model's."""

    def _window_left(self, window):
        return super()._window_left(window) + 1


@dataclass
class Seq:
    tokens: list
    table: list
    done: int = 0                   # positions computed so far


@dataclass
class Report:
    case: Case
    rows: int
    scale: float                    # the largest |logit| of the truth
    tol: float
    ref_p99: float                  # the torch reference's 99th-percentile row error
    test_max: float                 # the test backend's largest row error
    worst: list = field(default_factory=list)   # (error, round, seq, position), worst first

    @property
    def ok(self) -> bool:
        return self.test_max <= self.tol

    def summary(self) -> str:
        where = ", ".join(f"{e:.3g} at {r} {s}@{p}" for e, r, s, p in self.worst[:3])
        return (f"{self.case.name}: {self.rows} rows, test max {self.test_max:.3g} vs tol "
                f"{self.tol:.3g} (ref p99 {self.ref_p99:.3g}, |logit| max {self.scale:.3g}); "
                f"worst: {where}")


def models(case: Case, device, test_backend) -> tuple[DecoderModel, DecoderModel, DecoderModel]:
    """(truth, ref, test), one set of weights rounded to the case's dtype.
    `test_backend(num_heads, num_kv_heads, head_dim, sliding_window)`."""
    cfg = model_config(case)
    g = torch.Generator().manual_seed(1234 + case.group)
    weights = random_weights(cfg, 1234 + case.group)
    for name, w in weights.items():          # non-trivial norms: a mix-up would show
        if name.endswith("norm.weight"):
            w.add_(torch.randn(w.shape, generator=g) * 0.1)
    rounded = {k: v.to(case.dtype) for k, v in weights.items()}
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
    truth = DecoderModel(cfg, {k: v.float() for k, v in rounded.items()}, torch.float32,
                         device, TorchAttention(*shape))
    ref = DecoderModel(cfg, rounded, case.dtype, device, TorchAttention(*shape))
    test = DecoderModel(cfg, rounded, case.dtype, device, test_backend(*shape))
    return truth, ref, test


def sequences(case: Case) -> dict[str, Seq]:
    """Prompts, and block tables scattered through the pool."""
    rng = random.Random(7)
    decodes = {k: sum(k in dec for _, _, dec in SCHEDULE) for k in PROMPTS}
    pages = list(range(1, 1 + sum(-(-(n + decodes[k]) // PAGE) for k, n in PROMPTS.items())))
    rng.shuffle(pages)
    out = {}
    for k, n in PROMPTS.items():
        need = -(-(n + decodes[k]) // PAGE)
        out[k] = Seq([rng.randrange(1, 256) for _ in range(n)], pages[:need])
        pages = pages[need:]
    return out


def pool_pages(seqs: dict[str, Seq]) -> int:
    return 1 + max(max(s.table) for s in seqs.values())


def _round(seqs, prefills, decodes, device, window=None):
    """(ids, meta, keys): one round's inputs; keys[i] names row i."""
    ids, pos, slots, metas, keys = [], [], [], [], []
    for name, n in prefills:
        s = seqs[name]
        metas.append(SeqMeta(len(ids), n, s.done + n, s.table))
        for p in range(s.done, s.done + n):
            ids.append(s.tokens[p])
            pos.append(p)
            slots.append(s.table[p // PAGE] * PAGE + p % PAGE)
            keys.append((name, p))
    for name in decodes:
        s = seqs[name]
        p = s.done
        metas.append(SeqMeta(len(ids), 1, p + 1, s.table))
        ids.append(s.tokens[p])
        pos.append(p)
        slots.append(s.table[p // PAGE] * PAGE + p % PAGE)
        keys.append((name, p))
    t = torch.tensor(ids + pos + slots, device=device)
    n = len(ids)
    meta = BatchMeta(metas, t[2 * n:], t[n:2 * n], num_decodes=len(decodes), window=window)
    return t[:n], meta, keys


def run(model: DecoderModel, seqs: dict[str, Seq], extend: bool, no_sync: bool = False):
    """Every round of SCHEDULE through `model`; returns {(round, seq, pos):
    logits}. With `extend`, each decode appends the model's greedy token to
    its sequence (the truth writes the tokens the others are fed). With
    `no_sync` (CUDA), each round is planned first and its forward runs under
    torch.cuda.set_sync_debug_mode("error"): a host sync in any layer raises."""
    device = model.device
    cache = model.new_cache(pool_pages(seqs), PAGE)
    every = torch.arange(4096, device=device)
    out = {}
    for label, prefills, decodes in SCHEDULE:
        ids, meta, keys = _round(seqs, prefills, decodes, device, model.cfg.sliding_window)
        rows = every[:len(keys)]
        guard = nullcontext()
        if no_sync:
            model.attention.plan(meta, cache.layer(0)[0], model.dtype)
            torch.cuda.synchronize(device)
            guard = _sync_errors()
        with guard:
            logits = model.forward(ids, meta, cache, rows)
        logits = logits.float().cpu()
        for (name, p), row in zip(keys, logits):
            out[(label, name, p)] = row
        for name, n in prefills:
            s = seqs[name]
            s.done += n
            if extend and s.done == len(s.tokens):     # a completing chunk samples
                s.tokens.append(int(out[(label, name, s.done - 1)].argmax()))
        for name in decodes:
            s = seqs[name]
            s.done += 1
            if extend:
                s.tokens.append(int(out[(label, name, s.done - 1)].argmax()))
    return out


class _sync_errors:
    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def check(case: Case, device, test_backend, no_sync: bool = False) -> Report:
    """Run truth, ref and test on the same tokens; compare every row."""
    truth_m, ref_m, test_m = models(case, device, test_backend)
    seqs = sequences(case)
    prompts = {k: list(s.tokens) for k, s in seqs.items()}
    truth = run(truth_m, seqs, extend=True)
    fed = {k: Seq(list(s.tokens), s.table) for k, s in seqs.items()}   # the truth's tokens
    ref = run(ref_m, {k: Seq(list(s.tokens), s.table) for k, s in fed.items()}, extend=False)
    test = run(test_m, fed, extend=False, no_sync=no_sync)
    assert all(fed[k].tokens[:len(p)] == p for k, p in prompts.items())
    keys = list(truth)
    scale = max(float(truth[k].abs().max()) for k in keys)
    ref_err = torch.tensor([float((ref[k] - truth[k]).abs().max()) for k in keys])
    test_err = [float((test[k] - truth[k]).abs().max()) for k in keys]
    p99 = float(torch.quantile(ref_err, 0.99))
    tol = TOL_FACTOR * p99 + FLOOR * scale
    worst = sorted(((e, *k) for e, k in zip(test_err, keys)), reverse=True)[:5]
    return Report(case, len(keys), scale, tol, p99, max(test_err), worst)
