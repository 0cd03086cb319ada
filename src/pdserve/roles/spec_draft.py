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
    check_draft(model.cfg, target.cfg, draft_name(section))
    if model.device != torch.device(target.device):
        raise ConfigError(f"{KEY} ({draft_name(section)}) loaded on {model.device}, the "
                          f"target on {target.device}; they must share a device")
    return DraftModelProposer(model, pages, page_size)


def check_draft_section(section: dict, target_cfg) -> None:
    """The checks `load_draft` makes, from the draft's config alone (no
    weights read): what `pdserve up` runs before Ray starts."""
    from pdserve.kernels.loader import model_config_for

    path = section.get("path")
    cfg = model_config_for(path, None if path is not None else section.get("preset", "tiny"))
    check_draft(cfg, target_cfg, draft_name(section))


def check_draft(draft_cfg, target_cfg, name: str) -> None:
    """Refuse a draft (its ModelConfig) that cannot draft for the target
    (its ModelConfig), naming what differs."""
    dv, tv = draft_cfg.vocab_size, target_cfg.vocab_size
    if dv != tv:
        raise ConfigError(f"{KEY} ({name}) has a vocabulary of {dv:,} tokens where the "
                          f"target's has {tv:,}: a draft must share the target's tokenizer "
                          "and vocabulary; choose a draft model of the target's family "
                          "(the same tokenizer), or use method: ngram")
    if draft_cfg.state_group() is not None:
        raise ConfigError(f"{KEY} ({name}) is a {draft_cfg.arch}, whose layers keep a "
                          "recurrent state that a rejected candidate would leave advanced; "
                          "choose an attention-only draft model")
