"""A measured cost profile: one engine's round time fitted on a real device.

`pdserve calibrate` (sim/calibrate/sweep.py) times the real engine's rounds
and fits, by least squares, one linear form per round:

    seconds = overhead_s
            + multi_token_s    x M   (1 if the round computes more than one token)
            + prefill_chunk_s  x C   (prefill chunks: sequences being prefilled)
            + prefill_token_s  x P   (tokens those chunks compute)
            + prefill_pair_s   x Q   (their query x key pairs: a chunk of n
                                      tokens from position b has n(b + (n+1)/2))
            + decode_s         x D   (decoding requests)
            + decode_context_s x K   (the contexts those decodes attend over)

the features DistServe and Vidur profile (a fixed cost, linear GEMM work,
quadratic prefill attention, per-context decode attention), plus a cost per
sequence (C and D: attention and its metadata are built per sequence; the
tiny model on CPU spends more on that than on its arithmetic) and a step
from one token to several (M: one token's matrix-vector products take a
faster path than a matrix product; SmolLM2-135M on one CPU thread decodes
one request in 60 ms, computes a 16-token chunk in 165 ms and sixteen
decodes in 190 ms, and a linear form without M overestimates the lone
decode by 40-70%).
A model with sliding-window layers counts P, Q and K as the layers' mean:
a sliding layer's pairs and contexts are capped at its window.

Engines that share a host's cores slow each other down (on a GPU each has
its own device, and this is 0). `neighbour_slowdown` k says by how much: a
round that starts while n other engines of the deployment are computing
one takes (1 + k n) times its fitted time. `pdserve calibrate --copies 2`
measures it: it fits the form on a sweep with the host to itself, then
times the same sweep with a copy sweeping beside it; k is the median
(measured / fitted - 1) of the second sweep per copy. `calibrate --served`
fits it on a running deployment's own rounds instead
(sim/calibrate/served.py). Calibrating with a neighbour running the
whole time, as before, priced a lone engine 13-18% too slow and a busy
host's rounds 5-10% too fast.

On a shared host one linear form and one k do not follow the served
rounds: beside a neighbour, SmolLM2's decodes of 2-7 requests ran 1.27x the
form and decodes of 16-63 ran 0.82x. `served_factors`, which `calibrate
--served` fits, is a table of measured / form by round kind (prefill,
decode, mixed), decode-batch bucket (`BATCH_FROM`) and whether others were
computing; a round whose cell is in the table costs form x the cell (and
(1 + k) more per neighbour past the first), any other (1 + k n) x form.

`speed` (kind -> factor, default 1) multiplies every round of a kind on
top of that: the same profile on a host that runs that kind faster (< 1)
or slower. No calibration writes it; `bench sim-accuracy` sets it to put a
profile at the speed a run's own rounds showed, per kind, since a host's
drift need not move prefill and decode rounds alike (on 2026-12-02 decode
rounds ran 19% under the price while prefill rounds ran at it).

The file is YAML (see `Profile.to_dict`); `simulate: {profile: FILE}` in a
config makes the simulator use it instead of a GPU and model preset. The
profile carries the model's KV shape, so pages and transfers are sized as
the measured model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.engine.rounds import Round, computes, neighbours, round_kind, round_of  # noqa: F401
from pdserve.sim.cost.roofline import GPUS, MODELS, CostModel, ModelPreset, preset, window_pairs
from pdserve.scheduler.config import ConfigError, check_keys

KIND = "pdserve-cost-profile"
VERSION = 1
TERMS = ("overhead_s", "multi_token_s", "prefill_chunk_s", "prefill_token_s", "prefill_pair_s", "decode_s", "decode_context_s")
MODEL_KEYS = ("name", "layers", "q_heads", "kv_heads", "head_dim", "context", "kv_dtype_bytes",
              "sliding_layers", "window", "params", "kv_parts")
REQUIRED_MODEL = ("layers", "kv_heads", "head_dim", "context", "kv_dtype_bytes")


@dataclass(frozen=True)
class RoundCost:
    """The fitted coefficients, one per term of the form above (all >= 0)."""
    overhead_s: float
    multi_token_s: float
    prefill_chunk_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_s: float
    decode_context_s: float

    def seconds(self, features) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), features))

    def coefficients(self) -> tuple:
        return tuple(getattr(self, t) for t in TERMS)


BATCH_FROM = (0, 1, 2, 8, 16, 64)   # decode-batch buckets: none, 1, 2-7, 8-15, 16-63, 64+
KINDS = ("prefill", "decode", "mixed")


def batch_bucket(num_decodes: int) -> int:
    """The first decode batch of `num_decodes`' bucket (BATCH_FROM)."""
    for b in reversed(BATCH_FROM):
        if num_decodes >= b:
            return b
    return 0


def served_factor(table: dict, slowdown: float, kind: str, num_decodes: int, n: int) -> float:
    """What a round of `kind` with `num_decodes` decodes, begun while `n`
    other engines compute, costs against the form: the served table's cell
    where it has one (times (1 + k) per neighbour past the first), else
    (1 + k n), k the neighbour slowdown."""
    cell = table.get((kind, batch_bucket(num_decodes), min(n, 1)))
    if cell is None:
        return 1 + slowdown * n
    return cell * (1 + slowdown * (n - 1)) if n > 1 else cell


@dataclass(frozen=True)
class Profile:
    round: RoundCost
    model: ModelPreset
    copy_bytes_per_s: float               # host <-> device copies (L2 stores and loads)
    measured: dict = field(default_factory=dict)   # where and how well; informational
    neighbour_slowdown: float = 0.0       # per other engine computing beside a round
    # (kind, batch bucket, beside: 0 alone or 1 with others computing) -> measured / form
    served_factors: dict = field(default_factory=dict)
    speed: dict = field(default_factory=dict)     # kind -> factor on all its rounds

    def factor(self, kind: str, num_decodes: int, n: int) -> float:
        return served_factor(self.served_factors, self.neighbour_slowdown, kind, num_decodes,
                             n) * self.speed.get(kind, 1.0)

    def to_dict(self) -> dict:
        m = self.model
        return {
            "kind": KIND, "version": VERSION,
            "round": {t: float(v) for t, v in zip(TERMS, self.round.coefficients())},
            "copy_bytes_per_s": float(self.copy_bytes_per_s),
            "neighbour_slowdown": float(self.neighbour_slowdown),
            "model": {"name": m.name, "layers": m.layers, "q_heads": m.q_heads,
                      "kv_heads": m.kv_heads, "head_dim": m.head_dim, "context": m.context,
                      "kv_dtype_bytes": m.dtype_bytes, "sliding_layers": m.sliding_layers,
                      "window": m.window, "params": float(m.params),
                      **({"kv_parts": m.kv_parts} if m.kv_parts != 2 else {})},
            **({"served_factors": [
                {"kind": kind, "batch_from": b, "beside": beside, "factor": float(f)}
                for (kind, b, beside), f in sorted(self.served_factors.items())]}
               if self.served_factors else {}),
            **({"speed": {k: float(f) for k, f in sorted(self.speed.items())}}
               if self.speed else {}),
            "measured": dict(self.measured),
        }


def features(model: ModelPreset, prefills, decode_contexts: int, num_decodes: int,
             window_contexts: int | None = None) -> tuple:
    """(1, M, C, P, Q, D, K) of one round; `prefills` as (begin, tokens) chunks
    and the decodes' context sums as `CostModel.round_seconds` takes them."""
    tokens = pairs = 0.0
    for begin, n in prefills:
        tokens += n
        pairs += n * (begin + (n + 1) / 2)
    ctx = float(decode_contexts)
    if model.sliding_layers:
        w = model.window
        if window_contexts is None:
            window_contexts = min(decode_contexts, num_decodes * w)
        w_pairs = sum(window_pairs(b, n, w) for b, n in prefills)
        full, slide = model.full_layers / model.layers, model.sliding_layers / model.layers
        pairs = full * pairs + slide * w_pairs
        ctx = full * ctx + slide * window_contexts
    multi = 1.0 if tokens + num_decodes > 1 else 0.0
    return (1.0, multi, float(len(prefills)), tokens, pairs, float(num_decodes), ctx)


class ProfiledCostModel:
    """`CostModel`'s interface (round_seconds, round_factor, copy_seconds, model, window)
    over a measured profile."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.model = profile.model
        self.window = profile.model.window

    def round_seconds(self, prefills, decode_contexts: int, num_decodes: int,
                      window_contexts: int | None = None) -> float:
        if not computes(prefills, num_decodes):
            return 0.0
        return self.profile.round.seconds(
            features(self.model, prefills, decode_contexts, num_decodes, window_contexts))

    def copy_seconds(self, tokens: int, bytes_per_token: int | None = None) -> float:
        if not tokens:
            return 0.0
        return tokens * (bytes_per_token or self.model.kv_bytes_per_token) \
            / self.profile.copy_bytes_per_s

    def round_factor(self, has_prefill: bool, num_decodes: int, others: int) -> float:
        return self.profile.factor(round_kind(has_prefill, num_decodes), num_decodes, others)


def simulated_cost(gpu: str, model: str, profile: str | None):
    """(model preset, cost model) the simulator runs: the measured profile's
    when one is named, else the GPU and model presets' roofline."""
    if profile:
        p = load_profile(profile)
        return p.model, ProfiledCostModel(p)
    m = preset(MODELS, "model", model)
    return m, CostModel(m, preset(GPUS, "gpu", gpu))


# ---- the file ----------------------------------------------------------------

def _number(v, where: str, *, positive: bool = False) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if not ok or v < 0 or (positive and v == 0):
        raise ConfigError(f"{where} must be a finite number {'> 0' if positive else '>= 0'}, "
                          f"got {v!r}")
    return float(v)


def _count(v, where: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{where} must be an integer >= {minimum}, got {v!r}")
    return v


def profile_from_dict(data, source: str = "cost profile") -> Profile:
    """A validated Profile; a ConfigError names the field and what to fix."""
    data = check_keys(data, "profile", {"kind", "version", "round", "copy_bytes_per_s", "model",
                                        "measured", "neighbour_slowdown", "served_factors",
                                        "speed"})
    if not data:
        raise ConfigError("profile is empty; write one with `pdserve calibrate --config FILE "
                          "--out PROFILE.yaml`")
    if data.get("kind", KIND) != KIND:
        raise ConfigError(f"profile.kind is {data['kind']!r}, not {KIND!r}: this is not a "
                          "file `pdserve calibrate` wrote")
    if data.get("version", VERSION) != VERSION:
        raise ConfigError(f"profile.version is {data['version']!r}; this pdserve reads "
                          f"version {VERSION}: recalibrate with `pdserve calibrate`")
    for key in ("round", "model", "copy_bytes_per_s"):
        if key not in data:
            raise ConfigError(f"profile.{key} is missing; a profile needs round, model and "
                              "copy_bytes_per_s (rerun `pdserve calibrate`)")
    rnd = check_keys(data["round"], "profile.round", set(TERMS))
    missing = [t for t in TERMS if t not in rnd]
    if missing:
        raise ConfigError(f"profile.round lacks {', '.join(missing)}; it needs every term "
                          f"of the form: {', '.join(TERMS)}")
    coef = RoundCost(**{t: _number(rnd[t], f"profile.round.{t}") for t in TERMS})
    if not any(coef.coefficients()[1:]):
        raise ConfigError("profile.round charges nothing per token or request (every term "
                          "but overhead_s is 0); a round's time must grow with its work")
    m = check_keys(data["model"], "profile.model", set(MODEL_KEYS))
    missing = [k for k in REQUIRED_MODEL if k not in m]
    if missing:
        raise ConfigError(f"profile.model lacks {', '.join(missing)}; the simulator sizes "
                          "pages and transfers from them")
    ints = {k: _count(m[k], f"profile.model.{k}", 1) for k in REQUIRED_MODEL}
    kv_heads = ints["kv_heads"]
    q_heads = _count(m.get("q_heads", kv_heads), "profile.model.q_heads", 1)
    sliding = _count(m.get("sliding_layers", 0), "profile.model.sliding_layers", 0)
    window = _count(m.get("window", 0), "profile.model.window", 0)
    # 2: K and V a token; 1: latent attention's one entry (absent: 2)
    parts = _count(m.get("kv_parts", 2), "profile.model.kv_parts", 1)
    if parts > 2:
        raise ConfigError(f"profile.model.kv_parts must be 2 (K and V) or 1 (latent "
                          f"attention's one entry a token), got {parts}")
    params = _number(m.get("params", 0), "profile.model.params")
    name = m.get("name", "profiled")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"profile.model.name must be a non-empty string, got {name!r}")
    model = ModelPreset(name, params, ints["layers"], q_heads, kv_heads, ints["head_dim"],
                        ints["context"], dtype_bytes=ints["kv_dtype_bytes"],
                        sliding_layers=sliding, window=window, kv_parts=parts)
    measured = data.get("measured") or {}
    if not isinstance(measured, dict):
        raise ConfigError(f"profile.measured must be a mapping, got {type(measured).__name__}")
    copy = _number(data["copy_bytes_per_s"], "profile.copy_bytes_per_s", positive=True)
    slowdown = _number(data.get("neighbour_slowdown", 0.0), "profile.neighbour_slowdown")
    return Profile(coef, model, copy, measured, slowdown,
                   _served_factors(data.get("served_factors") or []),
                   _speed(data.get("speed") or {}))


def _speed(data) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(f"profile.speed must be a mapping of round kind to factor, "
                          f"got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in KINDS)
    if unknown:
        raise ConfigError(f"profile.speed has {', '.join(unknown)}; its keys are round kinds: "
                          f"{', '.join(KINDS)}")
    return {k: _number(f, f"profile.speed.{k}", positive=True) for k, f in data.items()}


def _served_factors(rows) -> dict:
    where = "profile.served_factors"
    if not isinstance(rows, list):
        raise ConfigError(f"{where} must be a list of {{kind, batch_from, beside, factor}}, "
                          f"got {type(rows).__name__}")
    out = {}
    for i, row in enumerate(rows):
        row = check_keys(row, f"{where}[{i}]", {"kind", "batch_from", "beside", "factor"})
        kind, b, beside = row.get("kind"), row.get("batch_from"), row.get("beside")
        if kind not in KINDS:
            raise ConfigError(f"{where}[{i}].kind is {kind!r}; use one of {', '.join(KINDS)}")
        if b not in BATCH_FROM:
            raise ConfigError(f"{where}[{i}].batch_from is {b!r}; use one of "
                              f"{', '.join(map(str, BATCH_FROM))}")
        if beside not in (0, 1):
            raise ConfigError(f"{where}[{i}].beside is {beside!r}; use 0 (the round ran "
                              "alone) or 1 (other engines computed beside it)")
        key = (kind, b, beside)
        if key in out:
            raise ConfigError(f"{where}[{i}] repeats {kind} from batch {b}, beside {beside}")
        out[key] = _number(row.get("factor"), f"{where}[{i}].factor", positive=True)
    return out


def load_profile(path) -> Profile:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"cost profile {str(p)!r} (simulate.profile) does not exist; write "
                          f"one with `pdserve calibrate --config CONFIG --out {p}` (a relative "
                          "path is read from the config file's folder)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"cost profile {p}: not valid YAML: {e}") from None
    try:
        return profile_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"cost profile {p}: {e}") from None


def save_profile(profile: Profile, path, header: str = "") -> None:
    import yaml

    text = yaml.safe_dump(profile.to_dict(), sort_keys=False)
    Path(path).write_text(header + text)

