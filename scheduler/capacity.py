"""What bounds a single request (spec §1.4): config only, no live pool state.

The bound is the largest prompt whose worst-case working set fits the pool.
It is not a live check: a request within the bound may still wait for room.
A request beyond it could never produce a forward, so ingest refuses it.
"""

from __future__ import annotations

from pdserve.scheduler.config import EngineConfig


def single_request_pages(cfg: EngineConfig, prompt_tokens: int) -> int:
    """Worst-case pages one request of `prompt_tokens` needs in the full-history
    group: the whole prompt plus the decode slot of its completing chunk."""
    return -(-(prompt_tokens + cfg.decode_input_tokens) // cfg.page_size)


def max_single_request_tokens(cfg: EngineConfig) -> int:
    """Largest prompt whose working set fits the pool, by binary search over
    `single_request_pages` (monotone in the prompt length), and within the
    model's context."""
    lo, hi = 0, cfg.max_context_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if single_request_pages(cfg, mid) <= cfg.total_pages:
            lo = mid
        else:
            hi = mid - 1
    return lo


def context_bound(cfg: EngineConfig) -> int:
    """Tokens one sequence (prompt plus generation) can ever occupy."""
    return min(cfg.max_context_tokens, cfg.total_pages * cfg.page_size)


def ingest_error(cfg: EngineConfig, prompt_tokens: int, max_new_tokens: int | None) -> str | None:
    """Why a request can never be served by this deployment, or None."""
    if prompt_tokens < 1:
        return "the prompt is empty; send at least one token"
    bound = max_single_request_tokens(cfg)
    pool = (f"engine.total_pages={cfg.total_pages} x page_size={cfg.page_size}, "
            f"model context {cfg.max_context_tokens}")
    # advise raising the pool only where the pool, not the model, is the limit
    pool_bound = cfg.total_pages * cfg.page_size < cfg.max_context_tokens
    if prompt_tokens > bound:
        fix = "raise engine.total_pages or shorten the prompt" if pool_bound else \
            "shorten the prompt (the model's context is the limit)"
        return (f"prompt of {prompt_tokens:,} tokens exceeds this deployment's bound of "
                f"{bound:,} ({pool}, minus a decode slot of {cfg.decode_input_tokens}); {fix}")
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            return f"max_new_tokens must be at least 1, got {max_new_tokens}"
        limit = context_bound(cfg)
        if prompt_tokens + max_new_tokens > limit:
            fix = f"lower max_new_tokens to at most {max(limit - prompt_tokens, 0):,}"
            fix += " or raise engine.total_pages" if pool_bound else \
                " (the model's context is the limit)"
            return (f"prompt of {prompt_tokens:,} tokens plus max_new_tokens={max_new_tokens:,} "
                    f"exceeds the {limit:,} tokens one sequence can occupy ({pool}); {fix}")
    return None
