"""Which models the disk tier serves (`check_model_served`), and which
weights its files were written for (`weights_fingerprint`, part of every
file's key: files of other weights are foreign)."""

from __future__ import annotations

import hashlib

import torch

from pdserve.scheduler.config import ConfigError, DiskCacheConfig


def check_model_served(cfg: DiskCacheConfig | None, model_cfg, state_block: int = 0,
                       sliding_replay: bool = False, state_checkpoints: bool = True) -> None:
    """Refuse a disk tier for a model whose hit the tier cannot restore.
    It stores the full-history group's pages, a state group's checkpoints
    and a cached sliding group's window pages. Served: every attention
    layer keeping full history (Llama, Qwen2/3, SmolLM2); recurrent-state
    layers beside them (Qwen3.5, LFM2) with engine.state_checkpoints (a hit
    ends at a checkpoint the disk holds, §1.2); sliding-window layers
    beside full ones (Gemma 3): under engine.sliding_replay a hit's first
    chunk recomputes each window from the full-history pages (§1.3),
    without it the hit reads each window's tail from disk. Refused by
    name: state layers without checkpoints, cached windows beside a state
    group (a hit would need both ends; no model has them), and models
    without a full-history layer. Raises ConfigError naming what to
    change."""
    if cfg is None:
        return
    groups = model_cfg.cache_groups()
    state = model_cfg.state_group(state_block)
    cached = [g.window for g in groups if g.sliding] if not sliding_replay else []
    if not groups or groups[0].sliding:
        why = "no full-history attention layer, so nothing the tier stores can start a hit"
    elif state is not None and not state_checkpoints:
        n = len(state.layers)
        why = (f"{n} layer{'s' if n != 1 else ''} keeping a recurrent state, and "
               "engine.state_checkpoints is off: a hit must restore the state checkpoint "
               "at its end, and none is kept to write to disk; turn state_checkpoints on")
    elif state is not None and cached:
        why = ("recurrent-state layers beside sliding-window layers whose tails a hit "
               "would read from disk, which the tier does not serve together; set "
               "engine.sliding_replay: true")
    else:
        return
    raise ConfigError(
        f"engine.disk_cache serves a model's full-history pages; {model_cfg.arch} has "
        f"{why}. Remove engine.disk_cache for this model (its host tier still caches "
        "prefixes)")


def weights_fingerprint(model) -> str:
    """A digest of the model's config and weights (every tensor the model
    holds, found through its attributes: its shape, dtype and a sample of
    its bytes): files written for other weights are foreign. Sampled, not
    whole: it runs once at start, and one changed weight file changes the
    samples of every tensor it loads."""
    h = hashlib.blake2b(digest_size=12)
    h.update(repr(model.cfg).encode())
    for name, t in _tensors(vars(model), "model"):
        flat = t.detach().reshape(-1)
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        mid = flat.numel() // 2
        for piece in (flat[:256], flat[mid:mid + 256], flat[-256:]):
            h.update(piece.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensors(obj, name: str, depth: int = 0):
    """(path, tensor) for every tensor under `obj`'s attributes, lists,
    tuples and dicts, in a stable order."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif depth > 4:
        return
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k], f"{name}.{k}", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{name}[{i}]", depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type) and depth:
        yield from _tensors(vars(obj), name, depth + 1)
