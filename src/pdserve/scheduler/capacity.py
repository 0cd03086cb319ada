"""What bounds a single request (spec §1.4): config only, no live pool state.

The bound is the largest prompt whose worst-case working set fits the pool.
It is not a live check: a request within the bound may still wait for room.
A request beyond it could never produce a forward, so ingest refuses it.

What the cache groups ask of every chunk (`group_bounds`) is checked here
too, once, when a planner starts: a config whose pools or budget cannot
serve even one request with the model's groups is refused there, not
discovered as a planner that never advances.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.scheduler.cache.groups import prefix_granularity, replay_window
from pdserve.scheduler.config import ConfigError, EngineConfig


def single_request_pages(cfg: EngineConfig, prompt_tokens: int) -> int:
    """Worst-case pages one request of `prompt_tokens` needs in the full-history
    group: the whole prompt plus the decode slot of its completing chunk."""
    return -(-(prompt_tokens + cfg.decode_input_tokens) // cfg.page_size)


def max_single_request_tokens(cfg: EngineConfig, full_history: bool = True) -> int:
    """Largest prompt whose working set fits the pool, by binary search over
    `single_request_pages` (monotone in the prompt length), and within the
    model's context. Without a full-history group (every layer sliding) the
    working set does not grow with the prompt: the context is the bound
    (the planner checks at start that each sliding pool holds one request)."""
    # the decode slot behind the prompt needs its positions within the context too
    ctx = cfg.max_context_tokens - cfg.decode_input_tokens
    if not full_history:
        return ctx
    lo, hi = 0, ctx
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if single_request_pages(cfg, mid) <= cfg.total_pages:
            lo = mid
        else:
            hi = mid - 1
    return lo


def sequence_pool_tokens(cfg: EngineConfig) -> int:
    """Prompt plus generation that the full-history pool holds for one
    request at its worst: a victim retracted before its last decode
    re-prefills prompt plus all but the last generated token, and the chunk
    that completes that history reserves the decode slot behind it. So
    prompt + max_new_tokens - 1 + decode_input_tokens must fit the pool, or
    the victim can never be readmitted (it would wait forever, and the FIFO
    behind it with it)."""
    return cfg.total_pages * cfg.page_size - (cfg.decode_input_tokens - 1)


def context_bound(cfg: EngineConfig, full_history: bool = True) -> int:
    """Tokens one sequence (prompt plus generation) can ever occupy: what
    the model's context allows and, with full history, what the pool can
    readmit (`sequence_pool_tokens`)."""
    if not full_history:
        return cfg.max_context_tokens
    return min(cfg.max_context_tokens, sequence_pool_tokens(cfg))


def ingest_error(cfg: EngineConfig, prompt_tokens: int, max_new_tokens: int | None,
                 full_history: bool = True) -> str | None:
    """Why a request can never be served by this deployment, or None."""
    if prompt_tokens < 1:
        return "the prompt is empty; send at least one token"
    bound = max_single_request_tokens(cfg, full_history)
    pool = (f"engine.total_pages={cfg.total_pages} x page_size={cfg.page_size}, "
            f"model context {cfg.max_context_tokens}")
    # advise raising the pool only where the pool, not the model, is the limit
    pool_bound = full_history and cfg.total_pages * cfg.page_size < cfg.max_context_tokens
    seq_pool_bound = full_history and sequence_pool_tokens(cfg) < cfg.max_context_tokens
    if prompt_tokens > bound:
        fix = "raise engine.total_pages or shorten the prompt" if pool_bound else \
            "shorten the prompt (the model's context is the limit)"
        return (f"prompt of {prompt_tokens:,} tokens exceeds this deployment's bound of "
                f"{bound:,} ({pool}, minus a decode slot of {cfg.decode_input_tokens}); {fix}")
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            return f"max_new_tokens must be at least 1, got {max_new_tokens}"
        limit = context_bound(cfg, full_history)
        if prompt_tokens + max_new_tokens > limit:
            fix = f"lower max_new_tokens to at most {max(limit - prompt_tokens, 0):,}"
            fix += " or raise engine.total_pages" if seq_pool_bound else \
                " (the model's context is the limit)"
            slot = ""
            if seq_pool_bound and cfg.decode_input_tokens > 1:
                # §1.4: a retracted request re-prefills all but its last token
                # and reserves the decode slot behind them
                slot = (f", less {cfg.decode_input_tokens - 1} for the decode slot of "
                        f"decode_input_tokens={cfg.decode_input_tokens} behind a retracted "
                        "request's re-prefilled history")
            return (f"prompt of {prompt_tokens:,} tokens plus max_new_tokens={max_new_tokens:,} "
                    f"exceeds the {limit:,} tokens one sequence can occupy ({pool}{slot}); "
                    f"{fix}")
    return None


def sliding_request_pages(cfg: EngineConfig, window: int, chunk_tokens: int) -> int:
    """Pages a sliding-window group holds for one request computing a chunk
    of `chunk_tokens` (spec §1.4): its lookback (W - 1), the chunk, the decode
    slot, and one more for a window that starts mid-page."""
    return -(-(window - 1 + chunk_tokens + cfg.decode_input_tokens) // cfg.page_size) + 1


STATE_SLOTS_PER_REQUEST = 2   # the working state and its growth block (spec §1.2)
STATE_SLOTS_PER_CHUNK = 2     # a chunk's read state and its checkpoint beside them


def state_slots(cfg: EngineConfig) -> int:
    """A snapshot-state group's pool: engine.state_slots, or enough for
    max_batch_size decoding requests (each its working state and growth
    block) and one prefill chunk's read state and checkpoint. Published
    checkpoints live in what is left, evicted first when it runs out."""
    if cfg.state_slots:
        return cfg.state_slots
    return STATE_SLOTS_PER_REQUEST * cfg.max_batch_size + STATE_SLOTS_PER_CHUNK


def group_pages(cfg: EngineConfig, groups) -> list[int]:
    """Each cache group's pool. Full history: engine.total_pages. Sliding:
    engine.sliding_pages, or by default enough for max_batch_size requests
    each holding its lookback and decode slot plus one round's chunk budget,
    never more than a full-history pool. Snapshot state: `state_slots`."""
    out = []
    for g in groups:
        if g.state:
            out.append(state_slots(cfg))
        elif not g.sliding:
            out.append(cfg.total_pages)
        elif cfg.sliding_pages:
            out.append(cfg.sliding_pages)
        else:
            per_request = sliding_request_pages(cfg, g.window, 1)
            chunk = -(-cfg.max_scheduled_tokens // cfg.page_size)
            out.append(min(cfg.total_pages, cfg.max_batch_size * per_request + chunk))
    return out


@dataclass(frozen=True)
class GroupBounds:
    """What an engine's cache groups ask of its chunks and decodes."""
    replay_tokens: int        # W of §1.3: rows a hit re-feeds (0: no replay)
    prefix_tokens: int        # a chunk that does not finish its prompt ends on a multiple
    state_reserve: int        # §1.2: a decoding role's state growth block (0: no state group)
    min_prefill_tokens: int   # a hit's first chunk: its replay rows, and still an advance


def group_bounds(cfg: EngineConfig, groups) -> GroupBounds:
    """The bounds of `groups` (checked by cache_groups.check_groups) under
    `cfg`, or a ConfigError naming the setting that leaves one request no
    way to advance: a state pool without a chunk's states, a token budget
    below a state block or a replayed hit's first chunk, a sliding pool
    without a window and a chunk."""
    ps = cfg.page_size
    replay_tokens = replay_window(groups)
    # chunks that do not finish a prompt end on a boundary every group can resume from
    prefix_tokens = prefix_granularity(groups, ps)
    state = next((g for g in groups if g.state), None)
    # §1.2: a decoding role's growth block, at least one block beyond the endpoint
    state_reserve = max(state.block_tokens(ps), cfg.decode_input_tokens) if state else 0
    if state:
        per_request = 3 + -(-state_reserve // state.block_tokens(ps))
        slots = group_pages(cfg, groups)[-1]
        if slots < per_request:
            raise ConfigError(
                f"engine.state_slots={slots} cannot hold one request's states: a chunk "
                f"reads one, writes a checkpoint and a final state, and reserves "
                f"{per_request - 3} growth block(s); raise state_slots to at least "
                f"{per_request}")
    if prefix_tokens > cfg.max_scheduled_tokens:
        raise ConfigError(
            f"engine.max_scheduled_tokens={cfg.max_scheduled_tokens} is below the state "
            f"block of {prefix_tokens} tokens: a chunk that does not finish its prompt "
            "ends on a block boundary, so no long prompt could advance; raise "
            "max_scheduled_tokens or lower engine.state_block")
    # a hit's first chunk spends its replay rows and must still advance (§1.3)
    min_prefill_tokens = -(-replay_tokens // ps) * ps + \
        max(replay_tokens, ps) if replay_tokens else 0
    if min_prefill_tokens > cfg.max_scheduled_tokens:
        raise ConfigError(
            f"engine.max_scheduled_tokens={cfg.max_scheduled_tokens} is below "
            f"{min_prefill_tokens}: with bounded replay of {replay_tokens} rows a "
            "hit's first chunk re-feeds them and must still advance; raise "
            "max_scheduled_tokens or turn replay off")
    for g, n in zip(groups, group_pages(cfg, groups)):
        if g.sliding and n < sliding_request_pages(cfg, g.window, cfg.max_scheduled_tokens):
            raise ConfigError(
                f"engine.sliding_pages={n} cannot hold one request's window of {g.window} "
                f"plus a chunk of max_scheduled_tokens={cfg.max_scheduled_tokens}: it "
                f"needs {sliding_request_pages(cfg, g.window, cfg.max_scheduled_tokens)}; "
                "raise sliding_pages (or total_pages) or lower max_scheduled_tokens")
    return GroupBounds(replay_tokens, prefix_tokens, state_reserve, min_prefill_tokens)


def capacity_report(cfg: EngineConfig, groups, page_bytes: list[int]) -> dict:
    """What the KV pools hold, counted with each group's retention: the
    tokens of full history (every request's, together), the windows each
    sliding pool holds at once, the bytes, and the bytes a model keeping
    every layer's history would need for the same tokens (what a server
    without cache groups allocates, and reports as its capacity)."""
    pages = group_pages(cfg, groups)
    ps = cfg.page_size
    out = []
    for g, n, b in zip(groups, pages, page_bytes):
        entry = {"retention": g.retention, "window": g.window, "layers": len(g.layers),
                 "pages": n, "page_bytes": b, "bytes": n * b}
        if g.sliding:
            entry["windows"] = n // sliding_request_pages(cfg, g.window, 1)
        out.append(entry)
    full = [e for e in out if e["retention"] == "full_history"]
    tokens = full[0]["pages"] * ps if full else cfg.max_context_tokens * min(
        e["windows"] for e in out)
    # every K/V group's layers, every token kept (a state layer keeps no K/V)
    per_token_all = sum(b for g, b in zip(groups, page_bytes) if not g.state) / ps
    return {"tokens": tokens, "groups": out, "bytes": sum(e["bytes"] for e in out),
            "bytes_every_layer_kept": int(tokens * per_token_all)}


def capacity_line(report: dict) -> str:
    """The startup log's account of the KV cache."""
    gib = 2 ** 30
    parts = []
    for e in report["groups"]:
        layers = f"{e['layers']} layers, " if e["layers"] else ""
        if e["retention"] == "full_history":
            parts.append(f"full history: {e['pages']:,} pages ({layers}{e['bytes'] / gib:.2f} GiB)")
        elif e["retention"] == "snapshot_state":
            parts.append(f"snapshot state: {e['pages']:,} slots ({layers}"
                         f"{e['bytes'] / gib:.2f} GiB)")
        else:
            parts.append(f"sliding window {e['window']}: {e['pages']:,} pages ({layers}"
                         f"{e['bytes'] / gib:.2f} GiB, {e['windows']:,} request windows)")
    line = f"KV cache holds {report['tokens']:,} tokens: " + "; ".join(parts)
    if len(report["groups"]) > 1:
        line += (f"; {report['bytes'] / gib:.2f} GiB in all, where keeping every layer's "
                 f"history would take {report['bytes_every_layer_kept'] / gib:.2f} GiB")
    return line

