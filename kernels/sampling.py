"""Sampling parameters and turning logits into tokens.

Randomness is keyed by (seed, token index), never by the order requests
happen to be batched, so a seeded request gives the same tokens whatever
the schedule, retractions included.

The whole batch samples at once, with no per-row kernels and one
device-to-host copy a round (the tokens, and the logprobs asked for):
temperature, top-k and top-p are masks over the batch, and each sampling
row draws by inverse CDF with one uniform number. That number is made on
the host from (seed, step) by a counter-based hash (splitmix64), so it
depends on nothing else; the CDF is summed in float64, so the summation
order (which CUDA's scan picks by the batch's shape) cannot move a token's
boundary, and a row gets the same token alone or in any batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pdserve.kernels.staging import stage, stage_rows


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16        # None: until the context limit
    temperature: float = 1.0           # 0: greedy
    top_k: int = 0                     # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple = field(default_factory=tuple)          # stop strings
    stop_token_ids: tuple = field(default_factory=tuple)
    ignore_eos: bool = False
    strict: bool = False               # reserve the whole generation at admission
    min_tokens: int = 0                # EOS and stop ids are masked, stop strings unseen, until
    logprobs: int | None = None        # None: no logprobs; k: the chosen token's and the top k

    def __post_init__(self):
        def bad(name, value, want):
            raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {want}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or
                                            not isinstance(self.max_tokens, int) or
                                            self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "give an integer >= 1, or None")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            bad("temperature", self.temperature, "give a finite number >= 0 (0 is greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "give an integer >= 0 (0 turns it off)")
        if not isinstance(self.top_p, (int, float)) or not math.isfinite(self.top_p) \
                or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "give a number in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", self.seed, "give an integer >= 0, or None")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "give an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"give at most max_tokens={self.max_tokens}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or
                                          not isinstance(self.logprobs, int) or
                                          not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"give an integer in [0, {MAX_LOGPROBS}], or None")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "give non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Logprob:
    """A sampled token's log-probability under the model's own distribution
    (before temperature, top-k and top-p), and the `top` most likely tokens
    as (token, logprob), most likely first."""
    token: int
    logprob: float
    top: tuple = ()




_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit integers that spreads
    every input bit over every output bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def row_uniform(seed: int, step: int) -> float:
    """The draw in [0, 1) for token `step` of a request seeded `seed`."""
    x = _mix64((_mix64((seed + 0x9E3779B97F4A7C15) & _M64) + step) & _M64)
    return (x >> 11) * 2.0 ** -53


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           fallback_seeds: list[int], stop_ids: frozenset = frozenset()):
    """One token per row, and a Logprob for rows that asked (else None).
    `steps[i]` is how many tokens row i's request has generated so far;
    `fallback_seeds[i]` seeds an unseeded request; `stop_ids` (EOS) are masked,
    with each row's stop_token_ids, while the row is short of min_tokens."""
    raw, dev, vocab = logits, logits.device, logits.shape[-1]
    mask_rows, mask_ids = [], []
    for i, sp in enumerate(params):
        if steps[i] < sp.min_tokens:
            ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(stop_ids))
            ids = sorted(t for t in ids if 0 <= t < vocab)
            mask_rows += [i] * len(ids)
            mask_ids += ids
    if mask_rows:
        r, c = stage_rows([mask_rows, mask_ids], dev)
        logits = logits.clone()
        logits[r, c] = float("-inf")
    tokens = logits.argmax(dim=-1)
    rows = [i for i, sp in enumerate(params) if not sp.greedy]
    if rows:
        seeds = [params[i].seed if params[i].seed is not None else fallback_seeds[i]
                 for i in rows]
        drawn, idx = _sample_rows(logits, [params[i] for i in rows], rows,
                                  [row_uniform(s, steps[i]) for s, i in zip(seeds, rows)])
        tokens.index_copy_(0, idx, drawn)
    return _fetch(raw, params, tokens)


def _sample_rows(logits, sps: list[SamplingParams], rows: list[int], draws: list[float]):
    """Tokens for the sampling rows `rows` (and those rows' index on the
    device): temperature, then top-k, then top-p, then inverse CDF."""
    vocab, n = logits.shape[-1], len(rows)
    ks = [sp.top_k if 0 < sp.top_k < vocab else 0 for sp in sps]
    by_k = [j for j in range(n) if ks[j]]
    by_p = [j for j in range(n) if sps[j].top_p < 1.0]
    # every parameter of the round in one host tensor, one copy (ints are exact in float64)
    temp, top_p, u, idx, kk, sub_k, sub_p = stage_rows(
        [[float(sp.temperature) for sp in sps], [float(sp.top_p) for sp in sps], draws,
         rows, [ks[j] for j in by_k], by_k, by_p], logits.device, torch.float64)
    idx = idx.long()
    x = logits.index_select(0, idx) / temp.to(logits.dtype)[:, None]
    if by_k:
        sub = sub_k.long()
        xs = x.index_select(0, sub)
        kth = xs.topk(max(ks), dim=-1).values.gather(1, kk.long()[:, None] - 1)
        x.index_copy_(0, sub, xs.masked_fill(xs < kth, float("-inf")))
    if by_p:
        sub = sub_p.long()
        xs = x.index_select(0, sub)
        desc = xs.sort(dim=-1, descending=True, stable=True).values
        p = torch.softmax(desc, dim=-1).double()
        keep = (p.cumsum(-1) - p) < top_p.index_select(0, sub)[:, None]  # a prefix, never empty
        cut = desc.gather(1, keep.sum(-1, keepdim=True) - 1)
        x.index_copy_(0, sub, xs.masked_fill(xs < cut, float("-inf")))
    weights = torch.exp(x - x.max(dim=-1, keepdim=True).values)          # masked: 0
    cdf = weights.double().cumsum(-1)
    drawn = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).view(-1)
    return drawn.clamp_(max=vocab - 1), idx


def _fetch(raw: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor):
    """Tokens and logprobs to the host in one copy."""
    rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    if not rows:
        return tokens.tolist(), [None] * len(params)
    k = max(params[i].logprobs for i in rows)
    idx = stage(rows, raw.device)
    lp = torch.log_softmax(raw.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, idx)[:, None]).view(-1)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    flat = torch.cat([tokens.double(), chosen.double(), top_v.reshape(-1).double(),
                      top_i.reshape(-1).double()]).tolist()
    B, n = len(params), len(rows)
    out_tokens = [int(t) for t in flat[:B]]
    chosen, top_v, top_i = flat[B:B + n], flat[B + n:B + n + n * k], flat[B + n + n * k:]
    out = [None] * B
    for j, i in enumerate(rows):
        m = params[i].logprobs
        top = tuple((int(top_i[j * k + t]), top_v[j * k + t]) for t in range(m))
        out[i] = Logprob(out_tokens[i], chosen[j], top)
    return out_tokens, out
