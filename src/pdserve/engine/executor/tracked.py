"""What the executor keeps for each live request (`Tracked`), and the
history its penalties read (`penalty_history`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.text.detokenize import Detokenizer
from pdserve.text.sampling_params import SamplingParams


@dataclass
class Tracked:
    """What the executor keeps for a live request: how it samples, its text
    so far, and the logprobs of its tokens not yet handed out."""
    params: SamplingParams
    seed: int
    detok: Detokenizer | None       # None: text is made elsewhere (an engine's output thread)
    logprobs: list = field(default_factory=list)
    tokens: int = 0                 # tokens taken (on_token calls)
    prior: int = 0                  # the prompt's last tokens that were output (a resubmission)
    prompt_seen: object = None      # the prompt's distinct tokens (numpy), once a penalty asks
    ended: bool = False             # a token ended it; one a round that ran ahead sampled is dropped
    grammar_done: bool = False      # its last token completed its grammar: text, not a stop token


def penalty_history(req, t: Tracked) -> tuple:
    """(prompt, output) as penalties see them: a resubmitted request's
    earlier output is the tail of its prompt here, and counts as output.
    Only the repetition penalty reads the prompt, and only its set of
    tokens: that is made once (numpy, distinct ids), not every round."""
    prompt, output = req.prompt.tokens, req.output
    cut = len(prompt) - t.prior
    if t.prior:
        output = prompt[cut:] + output
    if t.params.repetition_penalty == 1.0:
        return (), output
    if t.prompt_seen is None:
        t.prompt_seen = np.unique(np.asarray(prompt[:cut], dtype=np.int64))
    return t.prompt_seen, output
