"""The draft model an engine speculates with (engine.speculative.method:
draft): loaded by the loader the target's model goes through, on the
target's device, and refused at load where it cannot draft for it.

`draft_model:` takes what `model:` takes (a preset, a GGUF file or a
checkpoint directory; dtype and attention, by default the target's). The
draft must share the target's vocabulary: a candidate is a token id the
target scores, and a verify compares the two models' probabilities of the
same id. Its K/V live in the target's pages (`DraftLayout`): each of the
draft's cache groups joins the target's group of the same kind (full
history, or a sliding window of the same size), whose pages then hold the
draft's layers after the target's (kernels/kv_cache.py). So the planner
admits, counts, caches and frees them with the target's, the host and
disk tiers keep them, and P ships them to D in the same pages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.kernels.spec.draft_model import DraftModelProposer
from pdserve.kernels.kv_cache import KVShape
from pdserve.scheduler.config import ConfigError

KEY = "engine.speculative.draft_model"


def draft_name(section: dict) -> str:
    """How a draft model is named in messages and the P/D handshake's line."""
    if section.get("path") is not None:
        return f"path {section['path']}"
    return f"preset {section.get('preset', 'tiny')}"


@dataclass(frozen=True)
class DraftLayout:
    """Where a draft model's K/V live in the target's pages."""
    groups: tuple           # per draft cache group: the target's page group (an index into `kv`)
    shapes: tuple           # per target page group: the draft's layers in its pages, or None

    def caches(self, target_caches: list) -> list:
        """The draft's caches: its layers of the target's caches."""
        return [target_caches[g].draft_layers() for g in self.groups]


def load_draft_model(section: dict, target):
    """The draft model `section` names, checked against the `target` model
    it drafts for."""
    from pdserve.kernels.models.loader import load_model

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
    if model.dtype != target.dtype:
        raise ConfigError(f"{KEY}.dtype is {dtype}, the target's {target.dtype}: the draft's "
                          "K/V share the target's pages, which hold one dtype; leave "
                          f"{KEY}.dtype out (it follows the target's)")
    return model


def draft_layout(c, target_groups: list, name: str) -> DraftLayout:
    """Which of the target's page groups (`target_groups`, its
    CacheGroupSpecs without the state group) each cache group of the draft
    (its ModelConfig `c`) joins, or a ConfigError naming the one that fits
    none."""
    groups: list[int] = []
    shapes: list[KVShape | None] = [None] * len(target_groups)
    for d in c.cache_groups():
        g = next((i for i, t in enumerate(target_groups)
                  if t.retention == d.retention and t.window == d.window), None)
        what = f"a sliding window of {d.window}" if d.sliding else "full history"
        if g is None:
            raise ConfigError(f"{KEY} ({name}) has layers attending over {what}, which no "
                              "cache group of the target keeps; the draft's K/V live in the "
                              "target's pages, so choose a draft whose layers attend as some "
                              "of the target's do (full attention always fits a target with "
                              "full-attention layers)")
        if target_groups[g].replayable:
            raise ConfigError(f"{KEY} ({name}) has layers attending over {what}, whose cache "
                              "group the target regenerates after a prefix hit "
                              "(engine.sliding_replay), which the draft would need to replay "
                              "too; turn engine.sliding_replay off")
        groups.append(g)
        shapes[g] = KVShape(len(d.layers), c.num_kv_heads, c.head_dim)
    return DraftLayout(tuple(groups), tuple(shapes))


@dataclass
class DraftSetup:
    """An engine's draft model, where its K/V go, and the scratch pages its
    candidates past a block table take (after each page group's pool)."""
    model: object
    layout: DraftLayout
    scratch: int            # pages per target page group

    def scratch_pages(self, g: int) -> int:
        """Scratch pages after page group g's pool (none where the draft
        has no layers)."""
        return self.scratch if self.layout.shapes[g] is not None else 0

    def proposer(self, target_caches: list, pool_pages: list[int]) -> DraftModelProposer:
        """The proposer over the draft, whose K/V are the companion layers
        of `target_caches`; `pool_pages`: each page group's pool (both
        indexed as the executor's page groups), the pages the planner
        grants (the scratch pages follow them)."""
        scratch = [list(range(pool_pages[g], pool_pages[g] + self.scratch))
                   for g in self.layout.groups]
        return DraftModelProposer(self.model, self.layout.caches(target_caches), scratch,
                                  target_caches[0].page_size, self.layout.groups)



def load_draft(cfg, target, target_groups: list) -> DraftSetup | None:
    """The draft model engine.speculative names (None: no draft model),
    loaded beside `target` and placed in its page groups `target_groups`."""
    from pdserve.scheduler.speculation import SpecMethod

    spec = cfg.speculative
    if spec is None or spec.method is not SpecMethod.DRAFT:
        return None
    assert spec.draft_model is not None     # SpecConfig refuses draft without one
    model = load_draft_model(spec.draft_model, target)
    check_context(model.cfg, min(cfg.max_context_tokens, target.cfg.max_position),
                  draft_name(spec.draft_model))
    layout = draft_layout(model.cfg, target_groups, draft_name(spec.draft_model))
    # the pages name the draft's weights: the disk tier's keys and the P/D
    # layout then tell two drafts of one shape apart
    from pdserve.engine.disk.model_match import weights_fingerprint

    tag = weights_fingerprint(model)
    layout = DraftLayout(layout.groups, tuple(dataclasses.replace(s, tag=tag) if s else None
                                              for s in layout.shapes))
    # a request's candidates reach at most ceil(k / page_size) pages past
    # its table; room for 64 asking requests a round (more get none)
    scratch = min(cfg.max_batch_size, 64) * -(-spec.num_speculative_tokens // cfg.page_size)
    return DraftSetup(model, layout, scratch)


def check_draft_section(section: dict, target_cfg, engine=None) -> None:
    """The checks `load_draft` makes, from the configs alone (no weights
    read): what `pdserve up` runs before Ray starts. `engine`: the
    EngineConfig the draft serves under (its context and sliding replay)."""
    from pdserve.kernels.models.loader import model_config_for

    path = section.get("path")
    cfg = model_config_for(path, None if path is not None else section.get("preset", "tiny"))
    name = draft_name(section)
    check_draft(cfg, target_cfg, name)
    if engine is not None:
        check_context(cfg, min(engine.max_context_tokens, target_cfg.max_position), name)
        groups = target_cfg.cache_groups(replayable=engine.sliding_replay)
        draft_layout(cfg, [g for g in groups if not g.state], name)


def check_context(draft_cfg, max_context_tokens: int, name: str) -> None:
    """Refuse a draft that knows fewer positions than a request may reach
    (`max_context_tokens`, at most the target's own positions): its K/V are
    computed for every position the target computes."""
    if draft_cfg.max_position < max_context_tokens:
        raise ConfigError(f"{KEY} ({name}) knows {draft_cfg.max_position:,} positions, fewer "
                          f"than engine.max_context_tokens ({max_context_tokens:,}): its K/V "
                          "are computed beside the target's at every position a request "
                          "reaches; lower engine.max_context_tokens to at most "
                          f"{draft_cfg.max_position:,}, or choose a draft with a longer context")


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
