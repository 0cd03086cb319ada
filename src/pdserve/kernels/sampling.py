"""Turning logits into tokens (a request's SamplingParams are text/'s).

Randomness is keyed by (seed, token index), never by the order requests
happen to be batched, so a seeded request gives the same tokens whatever
the schedule, retractions included.

The whole batch samples at once, with no per-row kernels and one
device-to-host copy a round (the tokens, and the logprobs asked for). Each
sampling row turns its logits into weights once (temperature, then
softmax); top-k and top-p zero weights, and the row draws by inverse CDF
with one uniform number. That number is made on the host from (seed, step)
by a counter-based hash (splitmix64), so it depends on nothing else.

The work is a few passes over the vocabulary and no more: at 49,152 tokens
(SmolLM2) and 64 rows on a CPU, sorting every row for top-p took as long as
the model's forward, and a float64 running sum of every row a tenth of it
(docs/benchmarks.md, "Sampling a round's tokens"). The inverse CDF runs in two
levels: the mass of each block of BLOCK tokens, then a cumulative sum
inside the one block the draw lands in. Top-p looks for its cut among the
row's 256 most likely tokens, then its 4,096 (TOP_P_CANDIDATES), and sorts
the whole row only when those hold less than top_p; on CUDA, where a sort
is cheap and a host branch is a sync, it always sorts. Every sum runs over
a fixed-length block or in order along a row (float64 on CUDA, whose
reduction order follows the launch shape), so a row gets the same token
alone or in any batch.

Logit bias and the repetition, frequency and presence penalties change only
the cells of the rows that ask, the (row, token) pairs their histories
name, before any of that; min-p cuts the weights in one pass.
"""

from __future__ import annotations


import numpy as np
import torch

from pdserve.kernels.staging import stage, stage_rows
from pdserve.text.sampling_params import Logprob, SamplingParams


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


BLOCK = 256                  # tokens summed together by the inverse CDF's first level
TOP_P_CANDIDATES = (256, 4096)   # where top-p looks for its cut, in turn (CPU)


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
           fallback_seeds: list[int], stop_ids: frozenset = frozenset(), histories=None,
           earlier: list[int] | None = None, keep: list | None = None):
    """One token per row, and a Logprob for rows that asked (else None).
    `steps[i]` is how many tokens row i's request has generated so far;
    `fallback_seeds[i]` seeds an unseeded request; `stop_ids` (EOS) are masked,
    with each row's stop_token_ids, while the row is short of min_tokens.
    `histories[i]`: row i's (prompt tokens, output tokens), needed only for
    rows whose params penalize (else None, or the list may be None); lists
    or numpy arrays, and the prompt's distinct tokens are enough.
    `earlier[i]`: tokens row i's request generated before it was resubmitted
    (its draw is then that of token earlier[i] + steps[i], as if it had not
    been; None: none anywhere). `keep`: if given, the sampled tokens as a
    tensor on the logits' device are appended to it (a round that runs ahead
    feeds them to the next forward without a trip through the host)."""
    raw, dev, vocab = logits, logits.device, logits.shape[-1]
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, sp in enumerate(params):
        if steps[i] < sp.min_tokens:
            ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(stop_ids))
            ids = sorted(t for t in ids if 0 <= t < vocab)  # type: ignore[assignment]
            mask_rows += [i] * len(ids)
            mask_ids += ids
    if mask_rows:
        r, c = stage_rows([mask_rows, mask_ids], dev)
        logits = logits.clone()
        logits[r, c] = float("-inf")
    logits = _penalize(logits, params, histories)
    rows = [i for i, sp in enumerate(params) if not sp.greedy]
    if not rows:
        tokens = logits.argmax(dim=-1)
        if keep is not None:
            keep.append(tokens)
        return _fetch(raw, params, tokens)
    seeds = [params[i].seed if params[i].seed is not None else fallback_seeds[i] for i in rows]
    drawn, idx = _sample_rows(logits, [params[i] for i in rows], rows,
                              [row_uniform(s, steps[i] + (earlier[i] if earlier else 0))  # type: ignore[arg-type]
                               for s, i in zip(seeds, rows)])
    if len(rows) == len(params):
        tokens = drawn
    else:                            # greedy rows beside sampling ones
        tokens = logits.argmax(dim=-1)
        tokens.index_copy_(0, idx, drawn)
    if keep is not None:
        keep.append(tokens)
    return _fetch(raw, params, tokens)


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], bits) -> torch.Tensor:
    """`logits` with every token that row `rows[j]`'s grammar forbids at -inf
    (a copy; the other rows untouched, so rows without a grammar pay
    nothing). `bits`: int32 [len(rows), ceil(V / 32)], bit i of word w
    allowing token 32 w + i (text/grammar.py), filled on the host while the
    forward ran; it crosses to the device in one copy."""
    vocab, dev = logits.shape[-1], logits.device
    words = torch.from_numpy(bits)
    if dev.type == "cuda":
        words = words.pin_memory().to(dev, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    idx = stage(rows, dev)
    sub = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out.index_copy_(0, idx, sub)
    return out


def _penalize(logits, params: list[SamplingParams], histories):
    """The logits of the rows that penalize, changed in vLLM's order: the
    logit bias; the repetition penalty on every token of prompt and output
    (a positive logit divided by it, a negative one multiplied); the
    frequency penalty times each token's count in the output and the
    presence penalty once per token the output holds, subtracted. A new
    tensor if any row changes (`logits` itself may be the raw one, whose
    rows give logprobs). A bias on a token past the vocabulary is skipped:
    the router and `LLM` refuse one before it gets here."""
    rows = [i for i, sp in enumerate(params) if sp.penalizes]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("sample: rows with penalties or a logit_bias need histories, "
                         "each row's (prompt tokens, output tokens)")
    vocab = logits.shape[-1]
    b_r, b_c, b_v = [], [], []
    seen_n: list[int] = []
    seen: list[list[int]] = []
    held_n: list[int] = []
    held: list[list[int]] = []
    for j, i in enumerate(rows):
        sp = params[i]
        prompt, output = histories[i]
        bias = [(t, v) for t, v in sp.logit_bias if t < vocab]
        b_r += [j] * len(bias)
        b_c += [t for t, _ in bias]
        b_v += [v for _, v in bias]
        rep = sp.repetition_penalty != 1.0
        seen_n.append(len(prompt) + len(output) if rep else 0)
        seen += (prompt, output) if rep else ()
        pen = bool(sp.presence_penalty or sp.frequency_penalty)
        held_n.append(len(output) if pen else 0)
        held += (output,) if pen else ()
    sps = [params[i] for i in rows]
    idx, b_r, b_c, b_v, rep, freq, pres = stage_rows(  # type: ignore[assignment]
        [rows, b_r, b_c, b_v, [sp.repetition_penalty for sp in sps],
         [sp.frequency_penalty for sp in sps], [sp.presence_penalty for sp in sps]],
        logits.device, torch.float64)
    idx = idx.long()
    x = logits.index_select(0, idx)             # the rows, copied
    flat, dt = x.view(-1), x.dtype
    # only the (row, token) cells a history names are touched, never a whole row: a
    # cell named twice is gathered once and written twice with the same value
    if len(b_r):
        flat.index_put_((b_r.long() * vocab + b_c.long(),), b_v.to(dt), accumulate=True)  # type: ignore[attr-defined]
    cells = _cells(seen_n, seen, vocab, logits.device)
    if cells is not None:
        v, p = flat[cells], rep.to(dt)[cells // vocab]  # type: ignore[attr-defined]
        flat[cells] = torch.where(v > 0, v / p, v * p)
    cells = _cells(held_n, held, vocab, logits.device)
    if cells is not None:
        r = cells // vocab
        flat[cells] = flat[cells] - pres.to(dt)[r]                  # once per token held
        flat.index_put_((cells,), -freq.to(dt)[r], accumulate=True)  # once per occurrence
    if len(rows) == logits.shape[0]:
        return x
    out = logits.clone()
    out.index_copy_(0, idx, x)
    return out


def _cells(lengths: list[int], parts: list, vocab: int, device):
    """Row j's next lengths[j] tokens of `parts` (lists or numpy arrays,
    concatenated), as flat indices row * vocab + token on `device`; None if
    there are none. They go through numpy: torch.tensor on a list of ints
    is 4x slower."""
    if not sum(lengths):
        return None
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    tokens += np.repeat(np.arange(len(lengths), dtype=np.int64) * vocab, lengths)
    return stage(torch.from_numpy(tokens), device)


def _sample_rows(logits, sps: list[SamplingParams], rows: list[int], draws: list[float]):
    """Tokens for the sampling rows `rows` (and those rows' index on the
    device): temperature, then min-p, then top-k, then top-p, then inverse
    CDF."""
    w, u, idx = _weights(logits, sps, rows, draws)
    return _inverse_cdf(w, u), idx


def weights(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row's sampling weights, as `sample` draws from them (temperature,
    min-p, top-k, top-p; unnormalized, a float tensor of its own): what a
    speculative verify compares a draft against (kernels/spec/rejection.py)."""
    return _weights(logits, params, list(range(len(params))), [0.0] * len(params))[0]


def draw(w: torch.Tensor, draws: list[float]) -> torch.Tensor:
    """One token per row of weights `w`, by inverse CDF at `draws[i]` (a
    token of weight 0 is never drawn)."""
    return _inverse_cdf(w, stage(draws, w.device, torch.float64))


def _weights(logits, sps: list[SamplingParams], rows: list[int], draws: list[float]):
    """The weights of rows `rows`, their draws and their index, on the device."""
    vocab, n = logits.shape[-1], len(rows)
    ks = [sp.top_k if 0 < sp.top_k < vocab else 0 for sp in sps]
    by_k = [j for j in range(n) if ks[j]]
    by_p = [j for j in range(n) if sps[j].top_p < 1.0]
    by_m = [j for j in range(n) if sps[j].min_p > 0]
    # every parameter of the round in one host tensor, one copy (ints are exact in float64)
    temp, top_p, u, idx, kk, sub_k, sub_p, min_p, sub_m = stage_rows(
        [[float(sp.temperature) for sp in sps], [float(sp.top_p) for sp in sps], draws,
         rows, [ks[j] for j in by_k], by_k, by_p, [sps[j].min_p for j in by_m], by_m],
        logits.device, torch.float64)
    idx = idx.long()
    x = logits if n == logits.shape[0] else logits.index_select(0, idx)
    if any(sp.temperature != 1.0 for sp in sps):
        x = x / temp.to(logits.dtype)[:, None]
    w = torch.softmax(x, dim=-1)      # a tensor of its own: the raw logits give logprobs
    if by_m:
        # each row scaled so that its floor is 1, then cut there in one pass (a
        # compare and a masked fill took 3x as long); nothing after depends on a
        # row's scale, and the likeliest token, at 1 / min_p >= 1, always stays
        sub = sub_m.long()
        ws = w if len(by_m) == n else w.index_select(0, sub)
        scale = (ws.amax(dim=-1, keepdim=True) * min_p.to(w.dtype)[:, None]).reciprocal_()
        ws.mul_(scale.clamp_(max=torch.finfo(w.dtype).max))   # a floor under float32's: no inf
        _put_rows(w, sub, torch.nn.functional.threshold_(ws, 1.0 - 2.0 ** -20, 0.0))  # type: ignore[attr-defined]
    if by_k:
        sub = sub_k.long()
        ws = w if len(by_k) == n else w.index_select(0, sub)
        kth = ws.topk(max(ks), dim=-1).values.gather(1, kk.long()[:, None] - 1)
        _put_rows(w, sub, ws.masked_fill_(ws < kth, 0.0))
    if by_p:
        sub = sub_p.long()
        ws, tp = (w, top_p) if len(by_p) == n else (w.index_select(0, sub),
                                                    top_p.index_select(0, sub))
        _put_rows(w, sub, ws.masked_fill_(ws < _top_p_cut(ws, tp), 0.0))
    return w, u, idx


def _put_rows(w, sub, rows) -> None:
    """Rows `sub` of `w` become `rows` (nothing to do when they are w itself)."""
    if rows is not w:
        w.index_copy_(0, sub, rows)


def _block_cdf(w: torch.Tensor):
    """Each row's mass per block of BLOCK tokens (the last block may be
    short) and its running sum over the blocks, both float64."""
    full = w.shape[-1] // BLOCK
    acc = torch.float64 if w.is_cuda else torch.float32
    parts = [w.unfold(-1, BLOCK, BLOCK).sum(-1, dtype=acc)] if full else []
    if w.shape[-1] % BLOCK:
        parts.append(w[:, full * BLOCK:].sum(-1, keepdim=True, dtype=acc))
    mass = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).double()
    return mass, mass.cumsum(-1)


def _top_p_cut(w: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest weight top-p keeps ([rows, 1]): tokens are kept,
    the most likely first, while the mass before them is under top_p. On
    CPU the cut is looked for among each row's TOP_P_CANDIDATES largest
    weights, tier by tier, and a row is sorted whole only past the last."""
    vocab = w.shape[-1]
    tiers = [] if w.is_cuda else [k for k in TOP_P_CANDIDATES if k < vocab]
    return _cut_in_tiers(w, _block_cdf(w)[1][:, -1:], top_p, tiers + [vocab])


def _cut_in_tiers(w, total, top_p, tiers: list[int]) -> torch.Tensor:
    """The cut among the first tier's candidates; rows they do not cover
    look again in the next tier (the last tier is the whole vocabulary)."""
    cut, covered = _cut_among(w, total, top_p, tiers[0])
    if len(tiers) > 1:
        short = (~covered).nonzero().view(-1)
        if len(short):              # their cut lies beyond this tier's candidates
            pick = lambda t: t.index_select(0, short)        # noqa: E731
            cut.index_copy_(0, short, _cut_in_tiers(pick(w), pick(total), pick(top_p),
                                                    tiers[1:]))
    return cut


def _cut_among(w, total, top_p, k: int):
    """The cut among each row's k largest weights, and whether they hold top_p."""
    top = w.topk(k, dim=-1).values if k < w.shape[-1] else \
        w.sort(dim=-1, descending=True).values
    p = top.double() / total
    seen = p.cumsum(-1)
    keep = (seen - p) < top_p[:, None]                        # a prefix, never empty
    return top.gather(1, keep.sum(-1, keepdim=True) - 1), seen[:, -1] >= top_p


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token where the running weight first exceeds u times
    the row's mass: the block it lands in, then the token in that block (a
    vocabulary of one block: the token at once). A token of weight 0 is
    never drawn: the running weight does not rise at it."""
    vocab = w.shape[-1]
    if vocab <= BLOCK:
        cdf = w.double().cumsum(-1)
        drawn = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
        return drawn.clamp_(max=vocab - 1).view(-1)     # in range even if a logit was NaN
    mass, cdf = _block_cdf(w)
    target = (u * cdf[:, -1])[:, None]
    b = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    m = mass.gather(1, b)
    into = ((target - cdf.gather(1, b) + m) / m).clamp_(0.0, 1.0 - 2.0 ** -53)
    cols = b * BLOCK + torch.arange(BLOCK, device=w.device)
    wb = w.gather(1, cols.clamp(max=vocab - 1))
    if vocab % BLOCK:
        wb.masked_fill_(cols >= vocab, 0.0)
    inner = wb.double().cumsum(-1)
    j = torch.searchsorted(inner, into * inner[:, -1:], right=True).clamp_(max=BLOCK - 1)
    return cols.gather(1, j).clamp_(max=vocab - 1).view(-1)


def _fetch(raw: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor):
    """Tokens and logprobs to the host in one copy."""
    rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    if not rows:
        return tokens.tolist(), [None] * len(params)
    k = max(params[i].logprobs for i in rows)  # type: ignore[type-var]
    idx = stage(rows, raw.device)
    lp = torch.log_softmax(raw.index_select(0, idx).float(), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, idx)[:, None]).view(-1)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    flat = torch.cat([tokens.double(), chosen.double(), top_v.reshape(-1).double(),
                      top_i.reshape(-1).double()]).tolist()
    B, n = len(params), len(rows)
    out_tokens = [int(t) for t in flat[:B]]
    chosen, top_v, top_i = flat[B:B + n], flat[B + n:B + n + n * k], flat[B + n + n * k:]  # type: ignore[assignment, operator]
    out = [None] * B
    for j, i in enumerate(rows):
        m = params[i].logprobs
        top = tuple((int(top_i[j * k + t]), top_v[j * k + t]) for t in range(m))  # type: ignore[arg-type, operator]
        out[i] = Logprob(out_tokens[i], chosen[j], top)  # type: ignore[arg-type, call-overload]
    return out_tokens, out
