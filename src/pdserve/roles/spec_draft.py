"""The draft model an engine speculates with (engine.speculative.method:
draft): loaded by the loader the target's model goes through, on the
target's device, and refused at load where it cannot draft for it.

`draft_model:` takes what `model:` takes (a preset, a GGUF file or a
checkpoint directory; dtype and attention, by default the target's). The
draft must share the target's vocabulary: a candidate is a token id the
target scores, and a verify compares the two models' probabilities of the
same id. Its K/V live in a paged cache of its own (kernels/draft_pages.py),
of engine.total_pages pages of engine.page_size tokens: as many tokens as
the target's pool holds.
"""

from __future__ import annotations

import torch

from pdserve.kernels.draft_model import DraftModelProposer
from pdserve.scheduler.config import ConfigError

KEY = "engine.speculative.draft_model"


def draft_name(section: dict) -> str:
    """How a draft model is named in messages and the P/D handshake's line."""
    if section.get("path") is not None:
        return f"path {section['path']}"
    return f"preset {section.get('preset', 'tiny')}"


def load_draft(section: dict, target, page_size: int, pages: int) -> DraftModelProposer:
    """The proposer over the draft model `section` names, checked against
    the `target` model it drafts for."""
    from pdserve.kernels.loader import load_model

    dtype = section.get("dtype", "auto")
    if dtype == "auto":
        dtype = str(target.dtype).removeprefix("torch.")
    model, _ = load_model(section.get("path"), section.get("preset", "tiny") if
                          section.get("path") is None else None, dtype=dtype,
                          device=target.device, attention=section.get("attention", "auto"))
    check_draft(model, target, draft_name(section))
    return DraftModelProposer(model, pages, page_size)


def check_draft(draft, target, name: str) -> None:
    """Refuse a draft that cannot draft for `target`, naming what differs."""
    dv, tv = draft.cfg.vocab_size, target.cfg.vocab_size
    if dv != tv:
        raise ConfigError(f"{KEY} ({name}) has a vocabulary of {dv:,} tokens where the "
                          f"target's has {tv:,}: a draft must share the target's tokenizer "
                          "and vocabulary; choose a draft model of the target's family "
                          "(the same tokenizer), or use method: ngram")
    if any(g.state for g in draft.cache_groups()):
        family = getattr(draft.cfg, "arch", None) or type(draft).__name__
        raise ConfigError(f"{KEY} ({name}) is a {family}, whose layers keep a recurrent "
                          "state that a rejected candidate would leave advanced; choose an "
                          "attention-only draft model")
    if draft.device != torch.device(target.device):
        raise ConfigError(f"{KEY} ({name}) loaded on {draft.device}, the target on "
                          f"{target.device}; they must share a device")
