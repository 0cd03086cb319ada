"""A request as the planner sees it: prompt, limits, output, FSM state.

A prompt is either explicit token ids (`TokenPrompt`) or a chain of block
hashes standing for tokens (`BlockPrompt`, the Mooncake trace's `hash_ids`).
Both answer one question for the prefix index: what identifies the content
of page i. Generated tokens are always explicit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.scheduler.fsm import State


# Marks page 0's key of a request under an adapter: no token segment
# (a tuple of ints or of block triples) can equal a key that starts with it.
ADAPTER_SALT = "lora"


@dataclass(frozen=True)
class SamplingLimits:
    max_new_tokens: int | None = None   # None: until the context limit
    strict: bool = False                # reserve the whole generation up front


class TokenPrompt:
    __slots__ = ("tokens",)

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def segment(self, start: int, end: int):
        return tuple(self.tokens[start:end])


class BlockPrompt:
    """Tokens named by block hashes: block b holds `block_tokens` tokens that
    are a deterministic function of `hash_ids[b]`, so two prompts sharing a
    leading run of ids share that prefix token for token."""

    __slots__ = ("hash_ids", "block_tokens", "length")

    def __init__(self, hash_ids, length: int, block_tokens: int = 512):
        if length > len(hash_ids) * block_tokens:
            raise ValueError(
                f"prompt_tokens={length} exceeds {len(hash_ids)} hash_ids x "
                f"block_tokens={block_tokens}; give more hash_ids or a shorter length"
            )
        self.hash_ids = list(hash_ids)
        self.block_tokens = block_tokens
        self.length = length

    def __len__(self) -> int:
        return self.length

    def segment(self, start: int, end: int):
        bt = self.block_tokens
        parts = []
        while start < end:
            block = start // bt
            stop = min(end, (block + 1) * bt)
            parts.append((self.hash_ids[block], start - block * bt, stop - block * bt))
            start = stop
        return tuple(parts)


class Request:
    """One generation request. `state` is owned by `fsm.py`; the counters
    below are the hot-path view the planner reads every round."""

    __slots__ = (
        "id", "seq", "prompt", "prompt_len", "limits", "max_new_tokens",
        "output", "state", "slot", "retractions", "num_tokens", "capacity",
        "finish_reason", "error", "peer", "first_page", "yields_to", "adapter", "lora_slot",
        "disk_pages", "disk_wait", "cached", "drafts", "grammar_wait",
    )

    def __init__(self, id: str, prompt, limits: SamplingLimits = SamplingLimits(),
                 adapter: int = 0):
        if not isinstance(prompt, (TokenPrompt, BlockPrompt)):
            prompt = TokenPrompt(prompt)
        from pdserve.scheduler.fsm import Waiting

        self.id = id
        self.seq = -1                  # submission order, set by the planner
        self.prompt = prompt
        self.prompt_len = len(prompt)
        self.limits = limits
        self.max_new_tokens = 0        # resolved against the context limit at submit
        self.output: list[int] = []
        self.state: State = Waiting()
        self.slot = -1                 # stable index while resident
        self.retractions = 0
        self.num_tokens = self.prompt_len   # prompt + generated
        self.capacity = 0              # tokens the held pages of group 0 can hold
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.peer: str | None = None   # the other side of a P/D handoff (cluster's to set)
        self.first_page = 0            # P: the first page the peer does not hold already
        # A retraction victim: (the request it was retracted for, that one's
        # token count then); it re-enters after that one (round/prefill.yields, §2)
        self.yields_to: tuple[Request, int] | None = None
        # The LoRA adapter's load id (scheduler/lora/adapters.py), 0 for the base
        # model: the salt of every cache key, so KV computed under one adapter
        # never serves another, the base, or the same name loaded again.
        self.adapter = adapter
        self.lora_slot = -1            # the device adapter slot it references (adapter_slots.py)
        # The disk (L3) tier, as the engine's edge reports it (inputs, never
        # read from a disk here): the leading pages of the prompt the disk
        # can serve, and whether its prefetch policy still holds it back
        self.disk_pages = 0
        self.disk_wait = False
        # Prompt tokens its first admission found cached: (device, host, disk)
        self.cached = (0, 0, 0)
        # Speculative candidates for its next step, from the last round's
        # result (speculation.py): a decode then verifies them
        self.drafts: list[int] = []
        # Structured outputs: its grammar is still compiling (the engine's
        # edge sets and clears it); it is not admitted until it is ready
        self.grammar_wait = False

    def page_key(self, page: int, page_size: int):
        """What identifies the content of page `page` (full pages only).
        Page 0's key carries the adapter, and every later page is keyed by
        the chain through it: the prefix index, the host tier and what a D
        tells its P it holds are all salted by this one line."""
        if page == 0 and self.adapter:
            return (ADAPTER_SALT, self.adapter, self._page_key(0, page_size))
        return self._page_key(page, page_size)

    def _page_key(self, page: int, page_size: int):
        start, end = page * page_size, (page + 1) * page_size
        if end <= self.prompt_len:
            return self.prompt.segment(start, end)
        head = self.prompt.segment(start, self.prompt_len) if start < self.prompt_len else ()
        lo = max(start, self.prompt_len) - self.prompt_len
        return (head, tuple(self.output[lo:end - self.prompt_len]))

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output)

    def __repr__(self) -> str:
        return f"Request({self.id!r}, {type(self.state).__name__}, tokens={self.num_tokens})"
