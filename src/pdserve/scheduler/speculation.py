"""Speculative decoding as the planner sees it: the settings, and how many
candidates a decode carries.

A speculating request holds the candidates its proposer gave for its next
step (`Request.drafts`, set by `Planner.apply` from the round's result: the
executor proposes at the edge, the planner only counts). Its decode is then
a verify row: the last accepted token and up to k candidates, 1 + k
positions scored in one forward, each against the round's token budget
where decodes spend it. Pages are admitted for every position the row
writes; after the verify only the accepted tokens count (`num_tokens`), so
what the rejected positions wrote lies beyond the frontier, is never
published (publication stops below `num_tokens - 1`), and is overwritten by
the next forward. A sliding group lets go only of what slid out of the
window of the row's first position, the last accepted token.

The completing chunk reserves `decode_input_tokens = 1 + k` on every role
(spec §1), so a first verify, on D the one P's candidates ride with, fits
in the pages the prompt's admission took.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.scheduler.config_checks import ConfigError, check_keys, check_positive_int


class SpecMethod(enum.StrEnum):
    NGRAM = "ngram"         # prompt lookup: no weights (kernels/spec/proposers.py)
    DRAFT = "draft"         # a smaller model sharing the vocabulary (kernels/spec/draft_model.py)


MAX_SPEC_TOKENS = 16
# what draft_model takes of `model:`'s keys (it runs on the target's device)
DRAFT_MODEL_KEYS = ("path", "preset", "dtype", "attention")
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SpecConfig:
    """engine.speculative (`pdserve up --speculative-config JSON`, vLLM's names)."""
    method: SpecMethod = SpecMethod.NGRAM
    num_speculative_tokens: int = 3     # k: the most candidates one verify carries
    prompt_lookup_min: int = 2          # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 4          # ngram: the longest, tried first
    draft_model: dict | None = None     # draft: its model section (as `model:`)
    gate: bool = True                   # speculate only while it pays (engine/spec/gate.py)

    def __post_init__(self) -> None:
        w = "engine.speculative"
        methods = ", ".join(m.value for m in SpecMethod)
        if self.method not in {m.value for m in SpecMethod}:
            raise ConfigError(f"{w}.method is {self.method!r}, which does not exist; use one "
                              f"of {methods}")
        object.__setattr__(self, "method", SpecMethod(self.method))
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ConfigError(f"{w}.num_speculative_tokens must be an integer in [1, "
                              f"{MAX_SPEC_TOKENS}] (the candidates one verify carries), "
                              f"got {k!r}; to turn speculation off, leave out "
                              f"{w}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            check_positive_int(getattr(self, name), f"{w}.{name}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"{w}.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                              f"prompt_lookup_max={self.prompt_lookup_max}; lower the one or "
                              "raise the other")
        if not isinstance(self.gate, bool):
            raise ConfigError(f"{w}.gate must be true or false, got {self.gate!r}")
        if self.method is SpecMethod.DRAFT:
            if not isinstance(self.draft_model, dict) or not self.draft_model:
                raise ConfigError(f"{w}.method is draft: give {w}.draft_model, a model "
                                  "section (path or preset) sharing the target's tokenizer")
            _check_draft_model(self.draft_model, f"{w}.draft_model")
        elif self.draft_model is not None:
            raise ConfigError(f"{w}.draft_model is set but method is {self.method.value}; "
                              "set method: draft, or leave draft_model out")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @classmethod
    def from_dict(cls, data) -> "SpecConfig":
        import dataclasses

        return cls(**check_keys(data, "engine.speculative",
                                {f.name for f in dataclasses.fields(cls)}))

    def describe(self) -> str:
        """The settings both sides of a P/D pair must agree on, in one line."""
        s = f"method={self.method.value} num_speculative_tokens={self.k}"
        if self.method is SpecMethod.NGRAM:
            s += f" prompt_lookup_min={self.prompt_lookup_min} " \
                 f"prompt_lookup_max={self.prompt_lookup_max}"
        else:
            d = self.draft_model or {}
            s += " draft_model=" + ",".join(f"{key}:{d[key]}" for key in DRAFT_MODEL_KEYS
                                            if key in d)
        return s


def _check_draft_model(d: dict, where: str) -> None:
    """draft_model's keys, as `model:` takes them (the weights are checked
    against the target's when the engine loads them: engine/spec/draft.py)."""
    check_keys(d, where, set(DRAFT_MODEL_KEYS))
    if "path" in d and "preset" in d:
        raise ConfigError(f"{where} takes either path or preset, not both; remove one")
    for key in ("path", "preset"):
        if key in d and (not isinstance(d[key], str) or not d[key]):
            raise ConfigError(f"{where}.{key} must be a non-empty string, got {d[key]!r}")
    if "path" not in d and "preset" not in d:
        raise ConfigError(f"{where} names no model; give path: DIR | FILE.gguf or preset: NAME")
    if d.get("dtype", "auto") not in DRAFT_DTYPES:
        raise ConfigError(f"{where}.dtype is {d['dtype']!r}; use one of "
                          f"{', '.join(DRAFT_DTYPES)} (auto: the target's)")
    if d.get("attention", "auto") not in ("auto", "torch", "flashinfer"):
        raise ConfigError(f"{where}.attention is {d['attention']!r}; use auto, torch or "
                          "flashinfer")


def verify_width(req, budget: int | None) -> int:
    """Candidates `req`'s decode carries this round: its drafts, no more
    than its generation has room for beyond the verify's own token, nor
    than the token budget left beside that token (None: no budget)."""
    w = min(len(req.drafts), req.remaining_new_tokens - 1)
    if budget is not None:
        w = min(w, budget - 1)
    return max(w, 0)
