"""A request's sampling parameters (`SamplingParams`: what the client API,
the router, the engines and the offline API all pass), their checks, and
the `Logprob` a sampled token reports. Plain Python: the router builds and
checks them without torch; kernels/sampling.py turns them into tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.text.constraint import Constraint


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
    # what OpenAI's and vLLM's APIs call them, applied in vLLM's order (see `_penalize`)
    presence_penalty: float = 0.0      # subtracted once from every token the output holds
    frequency_penalty: float = 0.0     # subtracted per occurrence in the output
    repetition_penalty: float = 1.0    # tokens of prompt or output: logit / p if > 0, else * p
    min_p: float = 0.0                 # drop tokens below min_p times the likeliest's probability
    # (token id, bias) pairs; a dict is taken, and kept as its sorted pairs
    logit_bias: tuple | dict = field(default_factory=tuple)
    include_stop_str_in_output: bool = False   # the text ends after a stop string, not before
    skip_special_tokens: bool = True   # False: special tokens' own text is in the output
    # structured outputs: what the output must match (a JSON schema, a regex,
    # a choice, a grammar; text/grammar.py), None: anything
    constraint: Constraint | None = None

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
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, getattr(self, name), "give true or false")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                bad(name, v, "give a number in [-2, 2] (0 turns it off)")
        if not _number(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 10:
            bad("repetition_penalty", self.repetition_penalty,
                "give a number in [0.01, 10] (1 turns it off; above 1 discourages repeats)")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "give a number in [0, 1] (0 turns it off)")
        bias = self.logit_bias
        try:
            pairs = sorted((bias.items() if isinstance(bias, dict) else bias))
        except (TypeError, ValueError):
            pairs = None
        if pairs is None or any(not isinstance(p, (tuple, list)) or len(p) != 2 for p in pairs):
            bad("logit_bias", bias, "give {token id: bias} or (token id, bias) pairs")
        for t, v in pairs:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                bad("logit_bias", bias, f"token id {t!r} is not an integer >= 0")
            if not _number(v) or not -100 <= v <= 100:
                bad("logit_bias", bias, f"the bias {v!r} of token {t} is not a number in "
                    "[-100, 100]")
        if len({t for t, _ in pairs}) != len(pairs):
            bad("logit_bias", bias, "name each token id once")
        object.__setattr__(self, "logit_bias", tuple((t, float(v)) for t, v in pairs))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", self.stop, "give non-empty strings")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            bad("constraint", self.constraint, "give a text.grammar.Constraint, or None")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalizes(self) -> bool:
        """Whether the logits change with this request's tokens or a bias:
        sampling then needs its prompt and output (`sample`'s histories)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Logprob:
    """A sampled token's log-probability under the model's own distribution
    (before logit bias, penalties, temperature, min-p, top-k and top-p), and
    the `top` most likely tokens as (token, logprob), most likely first."""
    token: int
    logprob: float
    top: tuple = ()
