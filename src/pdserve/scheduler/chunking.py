"""Chunk cutting and reserves (spec §1): pure token arithmetic.

`prefill_chunk_tokens` is the one entry every prefill path calls to size a
chunk; `prefill_reserve` is the one place a chunk's reserve is decided.
"""

from __future__ import annotations


def prefill_chunk_tokens(begin: int, target: int, budget: int, page_size: int,
                         final_window: int = 0) -> int:
    """Tokens to compute this round for a prefill standing at `begin` of
    `target`, with `budget` tokens left in the round.

    A chunk that completes the prefill takes what it needs. Any other chunk
    is shortened to end on a page boundary, because a page is the unit of
    prefix caching and a chunk ending mid-page would leave a page no one can
    match. With bounded replay (`final_window` W, §1.3) no final chunk is
    shorter than W: a chunk that would leave 0 < rest < W leaves exactly W.
    Returns 0 when the budget cannot reach the next boundary."""
    remaining = target - begin
    if remaining <= 0 or budget <= 0:
        return 0
    if remaining <= budget:
        return remaining
    end = (begin + budget) // page_size * page_size
    if 0 < target - end < final_window:
        end = target - final_window
    return max(end - begin, 0)


def replay_rows(hit_tokens: int, window: int, page_size: int) -> int:
    """Rows a chunk after a prefix hit at `hit_tokens` re-feeds (§1.3):
    min(W, P), reaching down to a page boundary so the replayed group's
    pages hold nothing but rows this forward writes."""
    if not window or not hit_tokens:
        return 0
    return hit_tokens - (hit_tokens - min(window, hit_tokens)) // page_size * page_size


def admission_headroom(remaining_new_tokens: int, safe_steps: int, retractions: int) -> int:
    """Decode room an admission must secure (spec §4): one safe-step window
    per retraction so far plus one, capped by what the request can still use."""
    return min(remaining_new_tokens, safe_steps * (1 + retractions))


def prefill_reserve(*, decodes_locally: bool, first_chunk: bool, completes: bool,
                    rest_of_prompt: int, headroom: int, decode_width: int) -> int:
    """Tokens a full-history group holds beyond this chunk (spec §1, Reserve).

    The completing chunk holds the decode slot on every role. A decoding
    role's first chunk raises that to the rest of the prompt plus the
    admission headroom, and never less than the slot the completing chunk
    will ask for (a headroom of one token under a slot of two would strand
    it one page short), so a request it starts is never stranded mid-prompt
    or at its first decode. Intermediate chunks reserve nothing."""
    reserve = decode_width if completes else 0
    if decodes_locally and first_chunk:
        reserve = max(reserve, rest_of_prompt + max(headroom, decode_width))
    return reserve
