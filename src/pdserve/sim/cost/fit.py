"""Fitting a cost profile to timed rounds (sim/cost/profile.py's form).

`fit` minimizes the sum of |predicted / measured - 1| over the rounds:
relative, so a 5 ms round counts as much as a 2 s one; absolute, not
squared, so it fits the median and rounds another process slowed do not
drag it. Every coefficient is kept >= 0. `neighbour_slowdown` and
`fit_serving` add the shared host: how much longer a round runs while other
engines compute (`pdserve calibrate --copies`, `--served`); `fit_factors`
corrects the form per round kind and decode batch on served rounds.
"""

from __future__ import annotations

import statistics

from pdserve.sim.cost.roofline import ModelPreset
from pdserve.sim.cost.profile import Round, RoundCost, batch_bucket, features, served_factor

HOLD_OUT_EVERY = 4       # every 4th round is held out of a fit and its error reported
MIN_CELL = 8             # training rounds a served-factor cell needs to be kept


def fit(rounds: list[Round], model: ModelPreset, iterations: int = 30) -> RoundCost:
    """Non-negative least absolute relative error (see the module doc):
    iteratively reweighted least squares, each round weighted 1/|residual|,
    so a round another process slowed pulls the fit no more than any other."""
    import numpy as np

    x = np.array([features(model, r.prefills, r.decode_contexts, r.num_decodes,
                           r.window_contexts) for r in rounds], dtype=np.float64)
    y = np.array([r.seconds for r in rounds], dtype=np.float64)
    xr = x / y[:, None]                     # predicted / measured, per unit coefficient
    w = np.ones_like(y)
    coef = _nonnegative_lstsq(xr, np.ones_like(y), w)
    for _ in range(iterations):
        resid = np.abs(xr @ coef - 1)
        w = 1 / np.maximum(resid, 1e-3)
        coef = _nonnegative_lstsq(xr, np.ones_like(y), w)
    return RoundCost(*(float(c) for c in coef))


def _nonnegative_lstsq(x, y, w):
    """Weighted least squares with every coefficient >= 0: a term that comes
    out negative is dropped and the rest refitted."""
    import numpy as np

    sw = np.sqrt(w)
    xw, yw = x * sw[:, None], y * sw
    live = [j for j in range(x.shape[1]) if x[:, j].any()]
    coef = np.zeros(x.shape[1])
    while live:
        # scale columns so features of 1 and of 10^6 pairs condition alike
        scale = np.abs(xw[:, live]).max(axis=0)
        sol = np.linalg.lstsq(xw[:, live] / scale, yw, rcond=None)[0] / scale
        if (sol >= 0).all():
            coef[live] = sol
            break
        live.pop(int(np.argmin(sol)))
    return coef


def _form(cost: RoundCost, r: Round, model: ModelPreset) -> float:
    return cost.seconds(features(model, r.prefills, r.decode_contexts, r.num_decodes,
                                 r.window_contexts))


def errors(cost: RoundCost, rounds: list[Round], model: ModelPreset,
           slowdown: float = 0.0, neighbours=None, table=None, speed=None) -> list[float]:
    """Relative error of each round's prediction: (predicted - measured) /
    measured; with `neighbours` (per round, the other engines computing as
    it began) each prediction is the form times `served_factor` of
    `table` (none: 1 + slowdown x n), and times a profile's `speed` for the
    round's kind."""
    n = neighbours or [0] * len(rounds)
    table, speed = table or {}, speed or {}
    return [_form(cost, r, model) * served_factor(table, slowdown, r.kind, r.num_decodes, k)
            * speed.get(r.kind, 1.0) / r.seconds - 1 for r, k in zip(rounds, n)]


def fit_factors(cost: RoundCost, pairs, model: ModelPreset, slowdown: float,
                min_rounds: int = MIN_CELL) -> dict:
    """The served-factor table (sim/cost/profile.py): for each round kind,
    decode-batch bucket and alone/beside others, the median measured / form
    of the (round, engines beside it) `pairs` that fall there (a neighbour
    past the first counted at (1 + slowdown) each); cells with fewer than
    `min_rounds` rounds are left out, and fall back to (1 + slowdown n).
    One linear form cannot follow a shared host: served decodes of 2-7 beside
    a neighbour ran 1.27x the form, decodes of 16-63 0.82x."""
    cells: dict = {}
    for r, n in pairs:
        key = (r.kind, batch_bucket(r.num_decodes), min(n, 1))
        extra = 1 + slowdown * max(n - 1, 0)
        cells.setdefault(key, []).append(r.seconds / (_form(cost, r, model) * extra))
    return {key: statistics.median(v) for key, v in cells.items() if len(v) >= min_rounds}


def neighbour_slowdown(cost: RoundCost, shared: list[Round], model: ModelPreset,
                       copies: int) -> float:
    """The profile's neighbour_slowdown: the median measured / fitted ratio
    of rounds timed beside `copies` others, less one, per copy (>= 0)."""
    ratio = statistics.median(1 / (1 + e) for e in errors(cost, shared, model))
    return max(0.0, ratio - 1) / copies


def fit_serving(cost, pairs, facts, step: float = 0.0125, top: float = 0.5):
    """(scale, neighbour_slowdown): the served rounds' level against the
    sweep's form `cost`, fitted with the slowdown per engine beside a round
    on (round, engines beside it) pairs. For each slowdown k on a grid of
    `step` up to `top`, the scale is the median measured / (form x (1 + k n));
    the k with the least summed |relative error| wins. The form's shape
    comes from the sweep's grid, which varies one feature at a time; served
    loads alone would leave its batched terms to chance."""
    rounds, beside = [r for r, _ in pairs], [k for _, k in pairs]
    best = None
    for i in range(int(round(top / step)) + 1):
        k = i * step
        ratios = [1 / (1 + e) for e in errors(cost, rounds, facts, k, beside)]
        scale = statistics.median(ratios)
        err = sum(abs(scale / r - 1) for r in ratios)
        if best is None or err < best[0]:
            best = (err, scale, k)
    return best[1], best[2]  # type: ignore[index]


def held_out_report(cost: RoundCost, held: list[Round], model: ModelPreset,
                    slowdown: float = 0.0, neighbours=None, table=None) -> dict:
    """|relative error| p50, p90 and max over held-out rounds, overall and by
    kind (`slowdown`, `neighbours`, `table`: as `errors` takes them)."""
    from pdserve.sim.report import percentile

    n = neighbours or [0] * len(held)

    def stats(pairs):
        e = [abs(x) for x in errors(cost, [r for r, _ in pairs], model, slowdown,
                                    [k for _, k in pairs], table)]
        return {"rounds": len(e), "p50": round(percentile(e, 0.5), 4),
                "p90": round(percentile(e, 0.9), 4), "max": round(max(e), 4)} if e else {}
    pairs = list(zip(held, n))
    out = {"all": stats(pairs)}
    for kind in ("prefill", "decode", "mixed"):
        s = stats([(r, k) for r, k in pairs if r.kind == kind])
        if s:
            out[kind] = s
    return out
